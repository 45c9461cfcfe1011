// Stand-in for <cuda_fp16.h> in the SIMT host emulation (see simt.h).
#pragma once
#include "simt.h"
