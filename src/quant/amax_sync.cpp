// MAX all-reduce of many quantizers' amax over one group.
#include "src/quant/amax_sync.h"

#include <ATen/ATen.h>

#include <cstdint>
#include <optional>

#include "mdist/error.h"
#include "mdist/tp/collectives.h"

namespace mdist::quant::detail {
namespace {

// What a rank holds for one quantizer: empty when it has no amax, else its dtype then shape.
using Held = std::vector<int64_t>;

Held held(const TensorQuantizer& quantizer) {
  if (!quantizer->has_amax()) return {};
  const at::Tensor& amax = quantizer->amax();
  Held h{static_cast<int64_t>(amax.scalar_type())};
  for (const int64_t size : amax.sizes()) h.push_back(size);
  return h;
}

// Per quantizer, what the ranks that hold an amax hold (they must agree); empty when none.
std::vector<Held> agree(const std::vector<AmaxToSync>& quantizers,
                        const std::vector<std::vector<Held>>& per_rank) {
  std::vector<Held> merged(quantizers.size());
  for (const auto& rank_held : per_rank) {
    for (std::size_t i = 0; i < merged.size() && i < rank_held.size(); ++i) {
      const Held& h = rank_held[i];
      if (h.empty()) continue;
      if (!merged[i].empty() && merged[i] != h) {
        throw Error("mdist::quant: the ranks hold amaxes of different shapes or dtypes for " +
                    quantizers[i].name + "; they cannot be synced");
      }
      merged[i] = h;
    }
  }
  return merged;
}

}  // namespace

void sync_amax_max(const std::vector<AmaxToSync>& quantizers, const DistributedProcessGroup& group,
                   c10::Device device) {
  if (!group.is_initialized() || !group.group().is_member() || group.world_size() <= 1) return;
  std::vector<Held> mine;
  mine.reserve(quantizers.size());
  for (const auto& q : quantizers) mine.push_back(held(q.quantizer));
  const std::vector<Held> shapes = DistributedProcessGroup::get_dist_syncd_obj(
      mine, group,
      [&](const std::vector<std::vector<Held>>& all) { return agree(quantizers, all); });

  // Pack: fp32 holds every value of the narrower float dtypes exactly, so the max is exact.
  std::vector<at::Tensor> parts;
  for (std::size_t i = 0; i < quantizers.size(); ++i) {
    if (shapes[i].empty()) continue;
    const std::vector<int64_t> shape(shapes[i].begin() + 1, shapes[i].end());
    const TensorQuantizer& q = quantizers[i].quantizer;
    parts.push_back(q->has_amax()
                        ? q->amax().detach().to(device, at::kFloat).reshape({-1})
                        : at::zeros({c10::multiply_integers(shape)},
                                    at::TensorOptions().device(device).dtype(at::kFloat)));
  }
  if (parts.empty()) return;
  at::Tensor buffer = at::cat(parts).contiguous();
  tp::all_reduce_(buffer, group.group(), "max");

  int64_t offset = 0;
  for (std::size_t i = 0; i < quantizers.size(); ++i) {
    if (shapes[i].empty()) continue;
    const std::vector<int64_t> shape(shapes[i].begin() + 1, shapes[i].end());
    const auto dtype = static_cast<c10::ScalarType>(shapes[i].front());
    const int64_t numel = c10::multiply_integers(shape);
    TensorQuantizer q = quantizers[i].quantizer;  // a handle: set_amax writes the shared module
    const c10::Device target = q->has_amax() ? q->amax().device() : device;
    q->set_amax(buffer.narrow(0, offset, numel).view(shape).to(target, dtype));
    offset += numel;
  }
}

}  // namespace mdist::quant::detail
