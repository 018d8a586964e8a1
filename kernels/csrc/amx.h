// The AMX tile registers as every kernel that uses them sets them up: eight tiles of 16 rows
// x 64 bytes (a bf16 operand of 16 x 32, an fp32 sum of 16 x 16), and the process's
// permission to use them. The shapes are defined on every CPU (buffers are sized to them
// whichever kernel runs); the rest only where the build's CPU has AMX-BF16.
#pragma once

#include <cstdint>

namespace kvscope::amx {

constexpr int kTileRows = 16;      // rows of every tile
constexpr int kTileRowBytes = 64;  // bytes of a tile's row: 32 bf16 or 16 fp32

}  // namespace kvscope::amx

#if defined(__AMX_TILE__) && defined(__AMX_BF16__)
#include <immintrin.h>
#include <sys/syscall.h>
#include <unistd.h>

namespace kvscope::amx {

// ldtilecfg's 64-byte operand.
struct alignas(64) TileConfig {
  uint8_t palette = 1, start_row = 0, reserved[14] = {};
  uint16_t bytes_per_row[16] = {};
  uint8_t rows[16] = {};
};

// Sets this thread's eight tiles to 16 rows x 64 bytes; _tile_release gives them back.
inline void configure_tiles() {
  TileConfig config;
  for (int t = 0; t < 8; ++t) {
    config.rows[t] = kTileRows;
    config.bytes_per_row[t] = kTileRowBytes;
  }
  _tile_loadconfig(&config);
}

// Linux lends a process the tile registers once it asks for them (arch_prctl
// ARCH_REQ_XCOMP_PERM for XTILEDATA); oneDNN asks only when it first runs an AMX kernel.
inline bool permitted() {
  constexpr int kRequestPermission = 0x1023, kTileData = 18;
  static const bool granted = syscall(SYS_arch_prctl, kRequestPermission, kTileData) == 0;
  return granted;
}

}  // namespace kvscope::amx
#endif
