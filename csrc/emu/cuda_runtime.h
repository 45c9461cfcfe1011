// Stand-in for <cuda_runtime.h> in the SIMT host emulation (see simt.h).
#pragma once
#include "simt.h"
