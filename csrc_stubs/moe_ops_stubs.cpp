// C++ declarations of the moe_ops operator schemas, for consumers without Python (libtorch,
// programs exported with torch.export / AOTInductor). Keep identical to the Python schemas:
// tests/test_schemas.py compares them. Loading this library before `import moe_ops` is fine:
// the Python package then registers its kernels on these definitions.
#include <torch/library.h>

TORCH_LIBRARY(moe, m) {
  m.def("route(Tensor router_logits, int top_k, str scoring=\"softmax\", bool renormalize=True, Tensor? bias=None, int num_groups=1, int topk_groups=1, float scale=1.0) -> (Tensor topk_weights, Tensor topk_ids)");
  m.def("dispatch(Tensor hidden, Tensor w13, Tensor w2, Tensor topk_weights, Tensor topk_ids, str activation=\"silu\") -> Tensor");
  m.def("dispatch_backward(Tensor grad_out, Tensor hidden, Tensor w13, Tensor w2, Tensor topk_weights, Tensor topk_ids, str activation=\"silu\") -> (Tensor grad_hidden, Tensor grad_w13, Tensor grad_w2, Tensor grad_topk_weights)");
  m.def("dispatch_train(Tensor hidden, Tensor w13, Tensor w2, Tensor topk_weights, Tensor topk_ids, str activation=\"silu\") -> (Tensor out, Tensor z)");
  m.def("dispatch_backward_saved(Tensor grad_out, Tensor z, Tensor hidden, Tensor w13, Tensor w2, Tensor topk_weights, Tensor topk_ids, str activation=\"silu\") -> (Tensor grad_hidden, Tensor grad_w13, Tensor grad_w2, Tensor grad_topk_weights)");
}
