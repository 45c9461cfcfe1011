"""The parsing half of csrc/cuda_check.sh (`make cuda-check`); standard library only.

    python3 csrc/cuda_check.py info                  # what the shell script needs from torch / pip
    python3 csrc/cuda_check.py ptxas FILE.cu=LOG ...  # per-kernel ptxas budgets + the table
    python3 csrc/cuda_check.py sass FILE.cu=SASS ...  # no local-memory instruction in the SASS

Exit status 1 on a violation (with a line naming each), 0 otherwise.
"""

from __future__ import annotations

import fnmatch
import re
import shutil
import subprocess
import sys
from pathlib import Path

# ---------------------------------------------------------------------------------------------
# Register ceilings per kernel: the one table. Keys are fnmatch patterns over the demangled name
# without namespace and parameters (e.g. "scan_warp_kernel<__half, 16>"); the first match wins,
# kernels that match none get DEFAULT_REGISTER_CEILING. Each value is the most registers that
# kernel used with nvcc 13.0 (any dtype, sm_80 or sm_90a) + 8, rounded up to a multiple of 8.
# To raise one (a deliberate change that needs more registers): run `make cuda-check`, read the
# kernel's registers in the printed table, set its line here to that + 8 rounded up to a multiple
# of 8 and say why in the commit. A new kernel: add its line the same way (before a broader
# pattern that would also match it).
REGISTER_CEILINGS = [
    # (pattern, ceiling)                   most used, nvcc 13.0: sm_80 / sm_90a
    ("rowwise_argmax_kernel<*>", 40),    # 26 / 26
    ("scan_thread_kernel<*>", 40),       # 28 / 30
    ("scan_warp_kernel<*, 16>", 80),     # 67 / 64
    ("scan_warp_kernel<*, 8>", 56),      # 48 / 48
    ("scan_warp_kernel<*, 4>", 48),      # 37 / 37
    ("scan_warp_kernel<*, 2>", 48),      # 40 / 38
    ("scan_warp_kernel<*, 1>", 56),      # 48 / 48
    ("round_attention_kernel<*>", 72),   # 64 / 64 (key-tiled; the untiled one used 56 / 56)
    ("assemble_kernel<*>", 40),          # 25 / 25
]
DEFAULT_REGISTER_CEILING = 128  # a kernel with no line of its own (e.g. a new one until it gets one)
# ---------------------------------------------------------------------------------------------

# A copy of torch.utils.cpp_extension.COMMON_NVCC_FLAGS (torch 2.13), used only when no torch can
# be imported (then `info` says so): the flags are read from the installed torch otherwise.
FALLBACK_COMMON_NVCC_FLAGS = [
    "-D__CUDA_NO_HALF_OPERATORS__",
    "-D__CUDA_NO_HALF_CONVERSIONS__",
    "-D__CUDA_NO_BFLOAT16_CONVERSIONS__",
    "-D__CUDA_NO_HALF2_OPERATORS__",
    "--expt-relaxed-constexpr",
]


def project_nvcc_flags() -> list[str]:
    text = (Path(__file__).resolve().parent / "cuda" / "nvcc_flags.txt").read_text()
    return [a for a in (ln.split("#", 1)[0].strip() for ln in text.splitlines()) if a]


def info() -> int:
    """Lines "key<TAB>value" for the shell script: the project's nvcc flags, torch's nvcc flags,
    torch's include directories and C++ standard for extensions, a pip-installed cuobjdump."""
    out = [("nvcc_flag", f) for f in project_nvcc_flags()]
    try:
        import torch
        import torch.utils.cpp_extension as cpp_ext
    except Exception as exc:  # no torch for this interpreter
        out += [("torch", f"none ({type(exc).__name__}: {exc}); nvcc gets the copy of torch 2.13's "
                          "COMMON_NVCC_FLAGS in csrc/cuda_check.py")]
        out += [("torch_nvcc_flag", f) for f in FALLBACK_COMMON_NVCC_FLAGS]
    else:
        out += [("torch", f"{torch.__version__} (cuda {torch.version.cuda}) at {Path(torch.__file__).parent}")]
        out += [("torch_cuda", "1" if torch.version.cuda else "0")]
        out += [("torch_nvcc_flag", f) for f in cpp_ext.COMMON_NVCC_FLAGS]
        out += [("torch_include", p) for p in cpp_ext.include_paths()]  # the CPU set: no CUDA_HOME needed
        # the -std=... that load() gives the C++ compiler (not exported: read from its source)
        stds = re.findall(r"'-fPIC', '-std=(c\+\+\d+)'", Path(cpp_ext.__file__).read_text())
        out += [("torch_cxx_std", stds[0] if stds else "c++17")]
    for entry in sys.path:  # pip's nvidia-cuda-cuobjdump (+ nvidia-cuda-nvdisasm) wheels
        for tool in sorted(Path(entry or ".").glob("nvidia/cu*/bin/cuobjdump")):
            out += [("pip_cuobjdump", str(tool))]
    print("\n".join(f"{k}\t{v}" for k, v in out))
    return 0


# --------------------------------------------------------------------------- names

_demangled: dict[str, str] = {}


def demangle(names: list[str]) -> None:
    todo = sorted({n for n in names if n not in _demangled})
    if not todo:
        return
    res = None
    for tool in ("cu++filt", "c++filt"):
        exe = shutil.which(tool)
        if exe:
            try:
                res = subprocess.run([exe], input="\n".join(todo) + "\n", capture_output=True,
                                     text=True, check=True).stdout.splitlines()
                break
            except (OSError, subprocess.CalledProcessError):
                res = None
    if res is None or len(res) != len(todo):
        res = todo  # no demangler: keep the mangled names (the checks still run)
    _demangled.update(zip(todo, res))


def short_name(mangled: str) -> str:
    """'void (anonymous namespace)::scan_warp_kernel<float, 16>(float const*, ...)' ->
    'scan_warp_kernel<float, 16>'."""
    name = _demangled.get(mangled, mangled)
    if name == mangled:
        return name
    if name.startswith("void "):
        name = name[5:]
    depth, cut = 0, len(name)
    for i, c in enumerate(name):  # drop the parameter list: the first '(' outside <...>
        if c == "<":
            depth += 1
        elif c == ">":
            depth -= 1
        elif c == "(" and depth == 0 and not name.startswith("(anonymous", i):
            cut = i
            break
    name = name[:cut].replace("(anonymous namespace)::", "")
    return name


def ceiling(name: str) -> tuple[int, str]:
    for pattern, regs in REGISTER_CEILINGS:
        if fnmatch.fnmatchcase(name, pattern):
            return regs, pattern
    return DEFAULT_REGISTER_CEILING, "default"


# --------------------------------------------------------------------------- ptxas -v

RE_ENTRY = re.compile(r"Compiling entry function '([^']+)' for '(\w+)'")
RE_PROPS = re.compile(r"Function properties for (\S+)")
RE_FRAME = re.compile(r"(\d+) bytes stack frame, (\d+) bytes spill stores, (\d+) bytes spill loads")
RE_USED = re.compile(r"Used (\d+) registers")
RE_SMEM = re.compile(r"(\d+) bytes smem")


def parse_ptxas(text: str) -> tuple[list[dict], list[dict]]:
    """-> (entry kernels, other functions with properties), each a dict per (function, arch)."""
    kernels: dict[tuple[str, str], dict] = {}
    others: dict[tuple[str, str], dict] = {}
    arch = None
    entry = None
    props = None
    for line in text.splitlines():
        m = RE_ENTRY.search(line)
        if m:
            entry, arch = m.group(1), m.group(2)
            kernels[(entry, arch)] = {"fn": entry, "arch": arch, "regs": None, "smem": 0,
                                      "stack": None, "spill_st": None, "spill_ld": None}
            props = None
            continue
        m = RE_PROPS.search(line)
        if m:
            props = m.group(1)
            continue
        m = RE_FRAME.search(line)
        if m and props is not None:
            stack, st, ld = (int(g) for g in m.groups())
            if (props, arch) in kernels:
                d = kernels[(props, arch)]
            else:  # a device function compiled on its own (called, not inlined)
                d = others.setdefault((props, arch), {"fn": props, "arch": arch})
            d.update(stack=stack, spill_st=st, spill_ld=ld)
            props = None
            continue
        m = RE_USED.search(line)
        if m and entry is not None:
            d = kernels[(entry, arch)]
            d["regs"] = int(m.group(1))
            s = RE_SMEM.search(line)
            d["smem"] = int(s.group(1)) if s else 0
            entry = None
    return list(kernels.values()), list(others.values())


def ptxas(args: list[str]) -> int:
    rows, others, errors = [], [], []
    for arg in args:
        src, _, log = arg.partition("=")
        k, o = parse_ptxas(Path(log).read_text(errors="replace"))
        if not k:
            errors.append(f"{src}: no kernel in the ptxas -v output ({log}): nothing was checked")
        for d in k + o:
            d["src"] = src
        rows += k
        others += o
    demangle([d["fn"] for d in rows + others])
    for d in rows:
        d["name"] = short_name(d["fn"])
        d["ceiling"], d["rule"] = ceiling(d["name"])
        bad = []
        if d["regs"] is None or d["stack"] is None:
            bad.append("no register / stack line in the ptxas output")
        else:
            if d["regs"] > d["ceiling"]:
                bad.append(f"{d['regs']} registers > ceiling {d['ceiling']} ({d['rule']})")
            if d["spill_st"] or d["spill_ld"]:
                bad.append(f"spills: {d['spill_st']} bytes stored, {d['spill_ld']} bytes loaded")
            if d["stack"]:
                bad.append(f"{d['stack']} bytes stack frame (local memory)")
        d["bad"] = bad
        errors += [f"{d['src']}: {d['name']} [{d['arch']}]: {b}" for b in bad]
    for d in others:
        if d.get("stack") or d.get("spill_st") or d.get("spill_ld"):
            errors.append(f"{d['src']}: device function {short_name(d['fn'])} [{d['arch']}]: "
                          f"{d['stack']} bytes stack frame, {d['spill_st']} / {d['spill_ld']} "
                          f"bytes spill stores / loads")

    first: dict = {}
    for d in rows:  # source order (ptxas's), each kernel's targets together
        first.setdefault((d["src"], d["name"]), len(first))
    rows.sort(key=lambda d: (first[(d["src"], d["name"])], d["arch"]))
    multi = len({d["src"] for d in rows}) > 1
    head = ["kernel", "arch", "regs", "ceiling", "smem", "spill st/ld", "stack", ""]
    table = []
    for d in rows:
        name = f"{d['src']}: {d['name']}" if multi else d["name"]
        spill = f"{d['spill_st']}/{d['spill_ld']}" if d["spill_st"] is not None else "?"
        table.append([name, d["arch"], str(d["regs"]), str(d["ceiling"]), str(d["smem"]), spill,
                      str(d["stack"]), "FAIL" if d["bad"] else "ok"])
    widths = [max(len(r[i]) for r in [head] + table) for i in range(len(head))]
    fmt = lambda r: "  ".join(c.rjust(w) if 0 < i < len(r) - 1 else c.ljust(w)  # noqa: E731
                              for i, (c, w) in enumerate(zip(r, widths))).rstrip()
    print(f"  ptxas -v, {len(rows)} kernel builds (smem: static bytes; ceiling: csrc/cuda_check.py)")
    print("    " + fmt(head))
    for r in table:
        print("    " + fmt(r))
    for e in errors:
        print(f"  FAIL ptxas budget: {e}")
    if not errors:
        print(f"  ok   ptxas budget: every kernel 0 spill bytes, 0 bytes stack, registers <= ceiling")
    return 1 if errors else 0


# --------------------------------------------------------------------------- SASS

RE_FUNC = re.compile(r"^\s*Function\s*:\s*(\S+)")
RE_ARCH = re.compile(r"^\s*arch\s*=\s*(\w+)")
RE_LOCAL = re.compile(r"\b(LDL|STL)\b")


def sass(args: list[str]) -> int:
    errors, n_funcs = [], 0
    for arg in args:
        src, _, path = arg.partition("=")
        fn, arch, hits = None, "?", {}
        funcs = []
        for line in Path(path).read_text(errors="replace").splitlines():
            m = RE_ARCH.match(line)
            if m:
                arch = m.group(1)
                continue
            m = RE_FUNC.match(line)
            if m:
                fn = m.group(1)
                funcs.append(fn)
                continue
            if fn is not None and RE_LOCAL.search(line):
                hits.setdefault((fn, arch), []).append(" ".join(line.split()))
        if not funcs:
            errors.append(f"{src}: no function in the SASS ({path}): nothing was checked")
        n_funcs += len(funcs)
        demangle(funcs)
        for (f, a), lines in hits.items():
            errors.append(f"{src}: {short_name(f)} [{a}]: {len(lines)} local-memory instruction(s), "
                          f"e.g. {lines[0]}")
    for e in errors:
        print(f"  FAIL sass: {e}")
    if not errors:
        print(f"  ok   sass: no LDL/STL (local memory) in {n_funcs} kernels")
    return 1 if errors else 0


def main(argv: list[str]) -> int:
    if not argv:
        print(__doc__)
        return 2
    cmd, rest = argv[0], argv[1:]
    if cmd == "info":
        return info()
    if cmd == "ptxas":
        return ptxas(rest)
    if cmd == "sass":
        return sass(rest)
    print(f"unknown command {cmd!r}\n{__doc__}")
    return 2


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
