// AMX tile helpers shared by the native kernels (platforms/csrc/cpu_decode_step.cpp,
// attention_backends/csrc/flash_prefill.cpp): the tile configuration every thread loads before
// its tile instructions, and the once-per-process request Linux needs before it hands out the
// AMX register state. Included where __AMX_TILE__ is defined (built with -march=native on a CPU
// with AMX); platforms/native_build.py hashes quoted includes into each library's build key.
#pragma once

#include <cstdint>

#include <immintrin.h>

#include <sys/syscall.h>
#include <unistd.h>

namespace tokenmill_amx {

struct alignas(64) TileConfig {
  uint8_t palette, start_row, reserved[14];
  uint16_t colsb[16];
  uint8_t rows[16];
};

// Palette 1 with the first `tiles` registers at 16 rows x 64 bytes (the only shape used here).
inline void configure_tiles(int tiles = 8) {
  TileConfig config = {};
  config.palette = 1;
  for (int i = 0; i < tiles; ++i) {
    config.colsb[i] = 64;
    config.rows[i] = 16;
  }
  _tile_loadconfig(&config);
}

inline bool amx_ready() {
  static const bool ok = [] {
    constexpr long kRequestPermission = 0x1023, kTileData = 18;   // ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA
    return syscall(SYS_arch_prctl, kRequestPermission, kTileData) == 0;
  }();
  return ok;
}

}  // namespace tokenmill_amx
