#include <torch/extension.h>

#include "kernels.h"

bool supported() { return __builtin_cpu_supports("avx512f"); }

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("supported", &supported, "whether this CPU runs the kernels (AVX-512)");
  m.def("prefill_attention", &prefill_attention, "causal paged prefill attention, float32");
  m.def("decode_attention", &decode_attention, "paged decode attention, float32");
  m.def("rms_norm", &rms_norm, "RMSNorm, float32");
  m.def("add_rms_norm_", &add_rms_norm_, "residual add, then RMSNorm in place, float32");
  m.def("silu_and_mul", &silu_and_mul, "SwiGLU's silu(gate) * up, float32");
  m.def("rotate_", &rotate_, "rotary embedding in place, float32");
}
