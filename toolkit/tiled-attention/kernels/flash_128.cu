// The tiled attention's kernels at head dimensions up to 128 (flash.cuh).
#include "flash.cuh"

FLASH_ALL_TYPES(128)
