// The tensor-parallel collectives as autograd nodes on c10d.
#include "mdist/tp/collectives.h"

#include <ATen/ATen.h>
#include <torch/autograd.h>

#include <functional>
#include <string>
#include <utility>
#include <vector>

#include "mdist/error.h"
#include "mdist/runtime/c10d.h"
#include "mdist/runtime/runtime.h"
#include "src/nn/gradient_function.h"

namespace mdist::tp {
namespace {

using nn::detail::with_backward;

// Whether `group` has one rank, so the collective is the identity. A group this rank is not
// in has size -1 (torch's convention) and can carry nothing: an error naming it.
bool trivial(const Group& group) {
  const int ranks = size(group);
  if (ranks < 0) {
    throw Error("mdist::tp: a tensor-parallel collective over " + group.name() +
                ", which this rank is not a member of");
  }
  return ranks == 1;
}

int64_t normalise_dim(const at::Tensor& t, int64_t dim, const char* op) {
  const int64_t rank = t.dim();
  if (dim < -rank || dim >= rank) {
    throw Error(std::string("mdist::tp::") + op + ": dim " + std::to_string(dim) +
                " is out of range for a tensor of " + std::to_string(rank) + " dimensions");
  }
  return dim < 0 ? dim + rank : dim;
}

at::Tensor summed(const at::Tensor& t, const Group& group, const Counters& counters) {
  at::Tensor out = t.detach().contiguous().clone();
  all_reduce_(out, group, "sum", counters);
  return out;
}

at::Tensor gathered(const at::Tensor& t, const Group& group, int64_t dim,
                    const Counters& counters) {
  const int world = size(group);
  at::Tensor local = t.detach().contiguous();
  // all_gather_single along dim 0 of a [world, ...] buffer, then moved to `dim`.
  std::vector<int64_t> shape = local.sizes().vec();
  shape.insert(shape.begin(), world);
  at::Tensor flat = local.view({-1});
  at::Tensor out = at::empty({world * local.numel()}, local.options());
  if (counters) counters->add_all_gather(local.numel() * local.element_size());
  mdist::wait(process_group(group)->all_gather_single(out, flat), group, "tp::gather_from_group");
  out = out.view(shape);
  // [world, ..., d, ...] -> [..., world * d, ...]
  return out.movedim(0, dim).flatten(dim, dim + 1).contiguous();
}

at::Tensor own_slice(const at::Tensor& t, const Group& group, int64_t dim, const char* op) {
  const int world = size(group);
  if (t.size(dim) % world != 0) {
    throw Error(std::string("mdist::tp::") + op + ": size " + std::to_string(t.size(dim)) +
                " of dim " + std::to_string(dim) + " does not divide by the group's " +
                std::to_string(world) + " ranks");
  }
  const int64_t part = t.size(dim) / world;
  return t.detach().narrow(dim, rank(group) * part, part).contiguous();
}

}  // namespace

void all_reduce_(at::Tensor& tensor, const Group& group, const char* op, const Counters& counters) {
  if (trivial(group)) return;
  const std::string name = op;
  c10d::AllreduceOptions options;
  if (name == "sum") {
    options.reduceOp = c10d::ReduceOp::SUM;
  } else if (name == "max") {
    options.reduceOp = c10d::ReduceOp::MAX;
  } else {
    throw Error("mdist::tp::all_reduce_: op must be \"sum\" or \"max\", got \"" + name + "\"");
  }
  if (!tensor.is_contiguous()) {
    throw Error("mdist::tp::all_reduce_: the tensor must be contiguous");
  }
  if (counters) counters->add_all_reduce(tensor.numel() * tensor.element_size());
  std::vector<at::Tensor> tensors{tensor};
  mdist::wait(process_group(group)->allreduce(tensors, options), group, "tp::all_reduce");
}

at::Tensor copy_to_group(const at::Tensor& input, const Group& group, const Counters& counters) {
  if (trivial(group)) return input;
  return with_backward(
      input, input.tensor_data(), "mdist::tp::CopyToGroupBackward",
      [group, counters](const at::Tensor& grad) { return summed(grad, group, counters); });
}

at::Tensor reduce_from_group(const at::Tensor& input, const Group& group,
                             const Counters& counters) {
  if (trivial(group)) return input;
  return with_backward(input, summed(input, group, counters), "mdist::tp::ReduceFromGroupBackward",
                       [](const at::Tensor& grad) { return grad; });
}

at::Tensor gather_from_group(const at::Tensor& input, const Group& group, int64_t dim,
                             const Counters& counters) {
  dim = normalise_dim(input, dim, "gather_from_group");
  if (trivial(group)) return input;
  return with_backward(input, gathered(input, group, dim, counters),
                       "mdist::tp::GatherFromGroupBackward", [group, dim](const at::Tensor& grad) {
                         return own_slice(grad, group, dim, "gather_from_group");
                       });
}

at::Tensor scatter_to_group(const at::Tensor& input, const Group& group, int64_t dim,
                            const Counters& counters) {
  dim = normalise_dim(input, dim, "scatter_to_group");
  if (trivial(group)) return input;
  return with_backward(input, own_slice(input, group, dim, "scatter_to_group"),
                       "mdist::tp::ScatterToGroupBackward",
                       [group, dim, counters](const at::Tensor& grad) {
                         return gathered(grad, group, dim, counters);
                       });
}

void sum_gradients_over(const at::Tensor& param, const Group& group, const Counters& counters) {
  if (!param.is_leaf()) {
    throw Error("mdist::tp::sum_gradients_over: the tensor must be a leaf (a parameter)");
  }
  if (trivial(group)) return;
  // The hook's result replaces the gradient before it is accumulated.
  const_cast<at::Tensor&>(param).register_hook(
      [group, counters](const at::Tensor& grad) { return summed(grad, group, counters); });
}

}  // namespace mdist::tp
