import sys

from sglang_dlite.cli import main

sys.exit(main())
