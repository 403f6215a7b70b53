// C++ declarations of the moe_ops operator schemas, for consumers without Python (libtorch,
// programs exported with torch.export / AOTInductor). Keep identical to the Python schemas:
// tests/test_schemas.py compares them. Loading this library before `import moe_ops` is fine:
// the Python package then registers its kernels on these definitions.
#include <torch/library.h>

TORCH_LIBRARY(moe, m) {
  m.def("route(Tensor router_logits, int top_k, str scoring=\"softmax\", bool renormalize=True, Tensor? bias=None, int num_groups=1, int topk_groups=1, float scale=1.0) -> (Tensor topk_weights, Tensor topk_ids)");
  m.def("dispatch(Tensor hidden, Tensor w13, Tensor w2, Tensor topk_weights, Tensor topk_ids, str activation=\"silu\", Tensor? w13_bias=None, Tensor? w2_bias=None, float alpha=1.702, float limit=7.0, bool gate_up_interleaved=False, bool weights_on_input=False, Tensor? w13_scale=None, Tensor? w2_scale=None, int[]? block_shape=None, bool quantize_activations=True, Tensor? w3=None) -> Tensor");
  m.def("dispatch_backward(Tensor grad_out, Tensor hidden, Tensor w13, Tensor w2, Tensor topk_weights, Tensor topk_ids, str activation=\"silu\", Tensor? w13_bias=None, Tensor? w2_bias=None, float alpha=1.702, float limit=7.0, bool gate_up_interleaved=False, bool weights_on_input=False, Tensor? w13_scale=None, Tensor? w2_scale=None, int[]? block_shape=None, bool quantize_activations=True, Tensor? w3=None) -> (Tensor grad_hidden, Tensor grad_w13, Tensor grad_w2, Tensor grad_topk_weights, Tensor grad_w13_bias, Tensor grad_w2_bias, Tensor grad_w3)");
  m.def("dispatch_train(Tensor hidden, Tensor w13, Tensor w2, Tensor topk_weights, Tensor topk_ids, str activation=\"silu\", Tensor? w13_bias=None, Tensor? w2_bias=None, float alpha=1.702, float limit=7.0, bool gate_up_interleaved=False, bool weights_on_input=False, Tensor? w13_scale=None, Tensor? w2_scale=None, int[]? block_shape=None, bool quantize_activations=True, Tensor? w3=None) -> (Tensor out, Tensor z)");
  m.def("dispatch_backward_saved(Tensor grad_out, Tensor z, Tensor hidden, Tensor w13, Tensor w2, Tensor topk_weights, Tensor topk_ids, str activation=\"silu\", Tensor? w13_bias=None, Tensor? w2_bias=None, float alpha=1.702, float limit=7.0, bool gate_up_interleaved=False, bool weights_on_input=False, Tensor? w13_scale=None, Tensor? w2_scale=None, int[]? block_shape=None, bool quantize_activations=True, Tensor? w3=None) -> (Tensor grad_hidden, Tensor grad_w13, Tensor grad_w2, Tensor grad_topk_weights, Tensor grad_w13_bias, Tensor grad_w2_bias, Tensor grad_w3)");
}
