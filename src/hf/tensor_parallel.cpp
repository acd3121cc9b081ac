// hf::parallelize: the Llama family's tensor-parallel plan, and the plan's loss, logits and
// checkpoint views.
#include "mdist/hf/tensor_parallel.h"

#include <ATen/ATen.h>

#include <algorithm>
#include <map>
#include <set>
#include <string>
#include <utility>

#include "mdist/error.h"
#include "mdist/fsdp/fully_shard.h"
#include "mdist/fsdp/state_dict.h"
#include "mdist/nn/hooks.h"
#include "mdist/objects/collectives.h"
#include "mdist/runtime/c10d.h"
#include "mdist/runtime/device.h"
#include "mdist/runtime/runtime.h"
#include "mdist/tp/collectives.h"
#include "mdist/tp/cross_entropy.h"
#include "mdist/tp/layers.h"

namespace mdist::hf {
namespace {

using Split = TensorParallelPlacement::Split;

std::string sizes(const std::vector<int64_t>& shape) {
  std::string out = "[";
  for (std::size_t i = 0; i < shape.size(); ++i) out += (i ? ", " : "") + std::to_string(shape[i]);
  return out + "]";
}

// Rows (of dim 0) of a full tensor read at a time for a column slice: about 16 MiB.
int64_t chunk_rows(const std::vector<int64_t>& shape, int64_t element_size) {
  int64_t row = element_size;
  for (std::size_t i = 1; i < shape.size(); ++i) row *= shape[i];
  return std::max<int64_t>(1, (int64_t{16} << 20) / std::max<int64_t>(row, 1));
}

}  // namespace

std::vector<int64_t> TensorParallelPlacement::local_shape() const {
  std::vector<int64_t> shape = full_shape;
  if (split == Split::kRows) shape.at(0) = length;
  if (split == Split::kColumns) shape.at(1) = length;
  return shape;
}

std::vector<tp::RowRange> TensorParallelPlacement::row_ranges() const {
  if (!pieces.empty()) return pieces;
  return {tp::RowRange{offset, length}};
}

std::vector<tp::RowRange> TensorParallelPlacement::full_rows_of(int64_t first,
                                                                int64_t count) const {
  std::vector<tp::RowRange> out;
  int64_t local = 0;  // the first local row of the range below
  for (const tp::RowRange& range : row_ranges()) {
    const int64_t lo = std::max(first, local);
    const int64_t hi = std::min(first + count, local + range.count);
    if (lo < hi) out.push_back({range.first + (lo - local), hi - lo});
    local += range.count;
  }
  return out;
}

at::Tensor TensorParallelPlacement::local_part(const at::Tensor& full) const {
  if (split == Split::kColumns) return full.narrow(1, offset, length);
  if (split == Split::kReplicated) return full;
  std::vector<at::Tensor> parts;
  for (const tp::RowRange& range : row_ranges()) {
    parts.push_back(full.narrow(0, range.first, range.count));
  }
  return parts.size() == 1 ? parts.front() : at::cat(parts, 0);
}

TensorParallelPlan::TensorParallelPlan(Group group, int64_t vocab_size,
                                       std::map<std::string, TensorParallelPlacement> placements,
                                       bool holds_global_rank0, tp::Counters counters)
    : group_(std::move(group)),
      placements_(std::move(placements)),
      holds_global_rank0_(holds_global_rank0),
      counters_(counters ? std::move(counters) : std::make_shared<tp::CommCounters>()) {
  vocab_start_ = size() > 1 ? rank() * (vocab_size / size()) : 0;
}

int TensorParallelPlan::size() const { return group_.is_not_used() ? 1 : mdist::size(group_); }
int TensorParallelPlan::rank() const { return group_.is_not_used() ? 0 : mdist::rank(group_); }

TensorParallelPlacement TensorParallelPlan::placement(const std::string& name) const {
  const auto it = placements_.find(name);
  if (it != placements_.end()) return it->second;
  TensorParallelPlacement replicated;
  replicated.primary = rank() == 0;
  return replicated;
}

at::Tensor TensorParallelPlan::loss(const at::Tensor& logits, const at::Tensor& labels) const {
  if (size() == 1) return causal_lm_loss(logits, labels);
  return tp::vocab_parallel_causal_lm_loss(logits, labels, group_, vocab_start_, counters_);
}

at::Tensor TensorParallelPlan::full_logits(const at::Tensor& logits) const {
  if (size() == 1) return logits;
  return tp::gather_from_group(logits, group_, -1, counters_);
}

RowSource TensorParallelPlan::local_source(RowSource full) const {
  RowSource local;
  local.keys = full.keys;
  local.shape = [this, full](const std::string& name) {
    const auto it = placements_.find(name);
    if (it == placements_.end()) return full.shape(name);
    // The checkpoint's shape must be the full one the plan was made for; otherwise report
    // the checkpoint's own shape, so that the loader's size check names it.
    const std::vector<int64_t> shape = full.shape(name);
    if (shape != it->second.full_shape) return shape;
    return it->second.local_shape();
  };
  local.read = [this, full](const std::string& name, int64_t first_row, int64_t rows) {
    const auto it = placements_.find(name);
    if (it == placements_.end() || it->second.split == Split::kReplicated) {
      return full.read(name, first_row, rows);
    }
    const TensorParallelPlacement& p = it->second;
    if (p.split == Split::kRows) {
      if (rows < 0) {
        first_row = 0;
        rows = p.length;
      }
      std::vector<at::Tensor> parts;
      for (const tp::RowRange& range : p.full_rows_of(first_row, rows)) {
        parts.push_back(full.read(name, range.first, range.count));
      }
      return parts.size() == 1 ? parts.front() : at::cat(parts, 0);
    }
    // Columns: full rows a bounded number at a time, narrowed to this rank's columns.
    if (rows < 0) {
      first_row = 0;
      rows = p.full_shape.at(0);
    }
    const int64_t step = chunk_rows(p.full_shape, 4);
    std::vector<at::Tensor> parts;
    for (int64_t done = 0; done < rows; done += step) {
      const int64_t n = std::min(step, rows - done);
      parts.push_back(
          full.read(name, first_row + done, n).narrow(1, p.offset, p.length).contiguous());
    }
    return parts.size() == 1 ? parts.front() : at::cat(parts, 0);
  };
  return local;
}

std::map<std::string, at::Tensor> TensorParallelPlan::gather(
    const std::map<std::string, at::Tensor>& local) const {
  const int world = size();
  const bool keep = rank() == 0;
  std::map<std::string, at::Tensor> whole;
  if (world == 1) return local;
  const auto pg = process_group(group_);
  const c10::Device device = compute_device();
  for (const auto& [name, tensor] : local) {
    const auto it = placements_.find(name);
    if (it == placements_.end() || it->second.split == Split::kReplicated) {
      if (keep) whole[name] = tensor;
      continue;
    }
    const TensorParallelPlacement& p = it->second;
    at::Tensor input = tensor.to(device).contiguous().view({-1});
    std::vector<int64_t> shape = tensor.sizes().vec();
    shape.insert(shape.begin(), world);
    at::Tensor gathered = at::empty({world * input.numel()}, input.options());
    mdist::wait(pg->all_gather_single(gathered, input), group_, "hf::TensorParallelPlan::gather");
    gathered = gathered.view(shape);
    if (!keep) continue;
    // Ranks that hold the same values (a replicated KV head) are consecutive: keep the first.
    const int64_t total = p.split == Split::kRows ? p.full_shape.at(0) : p.full_shape.at(1);
    const int64_t replicas = world * p.length / total;
    std::vector<at::Tensor> parts;
    if (p.pieces.empty()) {
      for (int r = 0; r < world; r += static_cast<int>(replicas)) parts.push_back(gathered[r]);
    } else {
      // A fused weight: each of its parts (q, k, v; gate, up) is every rank's piece of it in
      // rank order (no replicas: parallelize refuses shared KV heads for fused weights).
      int64_t offset = 0;  // this part's first row in each rank's piece
      for (const tp::RowRange& piece : p.pieces) {
        for (int r = 0; r < world; ++r) parts.push_back(gathered[r].narrow(0, offset, piece.count));
        offset += piece.count;
      }
    }
    const at::Tensor joined = at::cat(parts, p.split == Split::kRows ? 0 : 1);
    if (joined.sizes().vec() != p.full_shape) {
      throw Error("mdist: hf::TensorParallelPlan::gather: '" + name + "' gathered as " +
                  sizes(joined.sizes().vec()) + ", expected " + sizes(p.full_shape));
    }
    whole[name] = joined.to(tensor.device());
  }
  return whole;
}

void check_tensor_parallel_split(const LlamaConfig& c, int t) {
  if (t < 1)
    throw Error("mdist: tensor parallel size must be at least 1, got " + std::to_string(t));
  if (t == 1) return;
  const auto fail = [t](const std::string& what) {
    throw Error("mdist: cannot split the model over " + std::to_string(t) +
                " tensor-parallel ranks: " + what);
  };
  const std::string ts = std::to_string(t);
  // Splitting the experts (tensor or expert parallelism) is not implemented yet.
  if (c.moe)
    fail(c.architecture +
         " is a mixture of experts; tensor parallelism of MoE layers is not supported yet");
  if (c.num_attention_heads % t != 0) {
    fail("num_attention_heads " + std::to_string(c.num_attention_heads) + " does not divide by " +
         ts);
  }
  const int64_t kv = c.num_key_value_heads;
  // A fused qkv_proj is cut as three row ranges of whole heads, and a full-width k norm sums
  // its squares over the ranks: neither has a place for a KV head shared by several ranks.
  if (kv % t != 0 && (c.fused_projections || c.qk_norm_full_width)) {
    fail("num_key_value_heads " + std::to_string(kv) + " does not divide by " + ts + " (" +
         c.architecture + "'s " +
         (c.fused_projections ? std::string("fused self_attn.qkv_proj")
                              : std::string("self_attn.k_norm over all KV heads")) +
         " splits by whole KV heads per rank)");
  }
  if (kv % t != 0 && t % kv != 0) {
    fail("num_key_value_heads " + std::to_string(kv) + " neither divides by " + ts +
         " nor divides it (each rank needs whole KV heads, or a KV head shared by whole ranks)");
  }
  if (c.intermediate_size % t != 0) {
    fail("intermediate_size " + std::to_string(c.intermediate_size) + " does not divide by " + ts);
  }
  if (c.vocab_size % t != 0) {
    fail("vocab_size " + std::to_string(c.vocab_size) + " does not divide by " + ts);
  }
}

namespace {

// This rank's share of the split (Megatron's: rank r holds the r-th part of every split
// dimension), and the groups it needs.
struct TpSplit {
  Group tp;
  int t = 1;                // ranks
  int r = 0;                // this rank
  bool holds_rank0 = true;  // this tensor-parallel group holds global rank 0
  int64_t head_dim = 0;
  int64_t heads = 0;           // query heads here
  int64_t kv = 0;              // KV heads of the model
  bool replicated_kv = false;  // fewer KV heads than ranks: each held by `replicas` ranks
  int64_t replicas = 1;
  int64_t kv_local = 0;    // KV heads here
  int64_t kv_first = 0;    // the first KV head held
  Group kv_group;          // the ranks sharing this rank's KV head (tp when not replicated)
  bool primary_kv = true;  // the first of them
  int64_t vocab_part = 0;
  int64_t intermediate = 0;  // here
};

// Every tensor-parallel group, in the same order on every rank (for new_group). Collective.
std::vector<std::vector<int>> all_tensor_parallel_groups(const std::vector<int>& mine) {
  std::vector<std::vector<int>> groups;
  for (auto& ranks : allgather(mine)) {
    if (std::find(groups.begin(), groups.end(), ranks) == groups.end()) groups.push_back(ranks);
  }
  std::sort(groups.begin(), groups.end());
  return groups;
}

// The split of `c` over `tp` (t > 1 ranks). Collective over the world: it learns every
// tensor-parallel group and, with replicated KV heads, makes the groups of the ranks sharing
// one (every rank makes every such group, in order).
TpSplit split_of(const LlamaConfig& c, const Group& tp, int t) {
  TpSplit s;
  s.tp = tp;
  s.t = t;
  s.r = rank(tp);
  const std::vector<int> mine = tp.ranks();
  const auto groups = all_tensor_parallel_groups(mine);
  s.holds_rank0 = std::find(mine.begin(), mine.end(), 0) != mine.end();
  s.head_dim = c.head_dim;
  s.heads = c.num_attention_heads / t;
  s.kv = c.num_key_value_heads;
  s.replicated_kv = s.kv < t;
  s.replicas = s.replicated_kv ? t / s.kv : 1;
  s.kv_local = s.replicated_kv ? 1 : s.kv / t;
  s.kv_first = s.replicated_kv ? (s.r / s.replicas) : s.r * s.kv_local;
  s.primary_kv = !s.replicated_kv || s.r % s.replicas == 0;
  s.vocab_part = c.vocab_size / t;
  s.intermediate = c.intermediate_size / t;
  s.kv_group = tp;
  if (s.replicated_kv) {
    for (const auto& ranks : groups) {
      for (int64_t head = 0; head < s.kv; ++head) {
        std::vector<int> sharing(ranks.begin() + head * s.replicas,
                                 ranks.begin() + (head + 1) * s.replicas);
        Group made = new_group(sharing);
        if (made.is_member()) s.kv_group = made;
      }
    }
  }
  return s;
}

// Cuts modules to this rank's part and records each parameter's placement.
class PlanBuilder {
 public:
  PlanBuilder(const TpSplit& split, tp::Counters counters)
      : s_(split), counters_(std::move(counters)) {}

  void rows_of(const std::string& name, const at::Tensor& param, int64_t offset, int64_t length,
               bool primary) {
    TensorParallelPlacement p;
    p.split = Split::kRows;
    p.offset = offset;
    p.length = length;
    p.full_shape = param.sizes().vec();
    p.primary = primary;
    placements[name] = p;
  }
  void columns_of(const std::string& name, const at::Tensor& param) {
    TensorParallelPlacement p;
    p.split = Split::kColumns;
    p.full_shape = param.sizes().vec();
    p.length = p.full_shape.at(1) / s_.t;
    p.offset = s_.r * p.length;
    placements[name] = p;
  }
  void replicated(const std::string& name, const at::Tensor& param) {
    TensorParallelPlacement p;
    p.full_shape = param.sizes().vec();
    p.length = p.full_shape.empty() ? 1 : p.full_shape[0];
    p.primary = s_.r == 0;
    placements[name] = p;
  }
  void column(const std::string& name, torch::nn::Linear& linear, int64_t offset, int64_t length,
              bool primary, bool copy_input) {
    rows_of(name + ".weight", linear->weight, offset, length, primary);
    if (linear->bias.defined()) rows_of(name + ".bias", linear->bias, offset, length, primary);
    tp::parallelize_column(
        *linear, s_.tp,
        {.copy_input = copy_input, .rows = tp::RowRange{offset, length}, .counters = counters_});
  }
  // A fused projection: rows from several ranges of the full weight, in this order.
  void column_pieces(const std::string& name, torch::nn::Linear& linear,
                     const std::vector<tp::RowRange>& pieces) {
    int64_t rows = 0;
    for (const tp::RowRange& piece : pieces) rows += piece.count;
    for (const char* part : {".weight", ".bias"}) {
      const at::Tensor& param = part[1] == 'w' ? linear->weight : linear->bias;
      if (!param.defined()) continue;
      rows_of(name + part, param, pieces.front().first, rows, true);
      placements[name + part].pieces = pieces;
    }
    tp::parallelize_column(*linear, s_.tp,
                           {.copy_input = false, .row_pieces = pieces, .counters = counters_});
  }
  void row(const std::string& name, torch::nn::Linear& linear) {
    columns_of(name + ".weight", linear->weight);
    if (linear->bias.defined()) replicated(name + ".bias", linear->bias);
    tp::parallelize_row(*linear, s_.tp, counters_);
  }
  // The input of q/k/v (and of gate/up) is copied to the group once, at the block's entry, so
  // that its gradient is all-reduced once rather than once per projection.
  void copy_first_input(torch::nn::Module& module) {
    nn::register_forward_pre_hook(
        module, [tp = s_.tp, counters = counters_](torch::nn::Module&, nn::TensorRefs& inputs) {
          if (!inputs.empty()) *inputs.front() = tp::copy_to_group(*inputs.front(), tp, counters);
        });
  }
  void sum_gradients_over(const at::Tensor& param, const Group& group) {
    tp::sum_gradients_over(param, group, counters_);
  }
  const tp::Counters& counters() const { return counters_; }

  std::map<std::string, TensorParallelPlacement> placements;

 private:
  const TpSplit& s_;
  tp::Counters counters_;
};

// OLMo 2's q/k RMSNorm over the whole projection width, of which this rank holds `width /
// t` features: the mean of squares is the group's sum of squares over the full width.
// reduce_from_group(copy_to_group(x)) all-reduces forward and backward alike: every rank's
// normalised features depend on every rank's squares, so each rank's gradient of the sum is
// the sum of the ranks' gradients.
void split_full_width_norm(PlanBuilder& plan, const TpSplit& s, RMSNormImpl& norm,
                           const std::string& name, int64_t offset, int64_t length) {
  plan.rows_of(name, norm.weight, offset, length, true);
  const int64_t width = norm.weight.size(0);
  tp::keep_rows(norm.weight, {tp::RowRange{offset, length}});
  norm.mean_square = [group = s.tp, counters = plan.counters(), width](const at::Tensor& h) {
    const at::Tensor local = h.pow(2).sum(-1, /*keepdim=*/true);
    return tp::reduce_from_group(tp::copy_to_group(local, group, counters), group, counters) /
           static_cast<double>(width);
  };
}

// q/k/v column-parallel by heads (KV heads replicated when fewer than ranks), o row-parallel.
// Phi-3's fused qkv_proj: this rank's query, key and value heads as three row ranges.
void split_attention(PlanBuilder& plan, const TpSplit& s, AttentionImpl& attn,
                     const std::string& prefix) {
  const int64_t hd = s.head_dim;
  const tp::RowRange q{s.r * s.heads * hd, s.heads * hd};
  const tp::RowRange kv{s.kv_first * hd, s.kv_local * hd};
  if (attn.qkv_proj) {
    const int64_t q_rows = s.heads * s.t * hd, kv_rows = s.kv * hd;
    plan.column_pieces(prefix + "qkv_proj", attn.qkv_proj,
                       {q, {q_rows + kv.first, kv.count}, {q_rows + kv_rows + kv.first, kv.count}});
  } else {
    plan.column(prefix + "q_proj", attn.q_proj, q.first, q.count, true, false);
    plan.column(prefix + "k_proj", attn.k_proj, kv.first, kv.count, s.primary_kv, false);
    plan.column(prefix + "v_proj", attn.v_proj, kv.first, kv.count, s.primary_kv, false);
  }
  if (s.replicated_kv) {
    for (auto* linear : {&attn.k_proj, &attn.v_proj}) {
      plan.sum_gradients_over((*linear)->weight, s.kv_group);
      if ((*linear)->bias.defined()) plan.sum_gradients_over((*linear)->bias, s.kv_group);
    }
  }
  plan.row(prefix + "o_proj", attn.o_proj);
  if (attn.q_norm && attn.qk_norm_full_width) {
    // Over the whole projection: each rank holds the weight of its own heads' features.
    split_full_width_norm(plan, s, *attn.q_norm, prefix + "q_norm.weight", q.first, q.count);
    split_full_width_norm(plan, s, *attn.k_norm, prefix + "k_norm.weight", kv.first, kv.count);
  } else if (attn.q_norm) {
    // Each rank normalises its own heads with the shared weight: its gradient is a sum over
    // the ranks.
    plan.replicated(prefix + "q_norm.weight", attn.q_norm->weight);
    plan.replicated(prefix + "k_norm.weight", attn.k_norm->weight);
    plan.sum_gradients_over(attn.q_norm->weight, s.tp);
    plan.sum_gradients_over(attn.k_norm->weight, s.tp);
  }
  attn.heads = s.heads;
  attn.kv_heads = s.kv_local;
  plan.copy_first_input(attn);
}

// gate/up column-parallel, down row-parallel (the intermediate size split). Phi-3's fused
// gate_up_proj: this rank's slice of the gate half, then its slice of the up half.
void split_mlp(PlanBuilder& plan, const TpSplit& s, MLPImpl& mlp, const std::string& prefix) {
  const tp::RowRange part{s.r * s.intermediate, s.intermediate};
  if (mlp.gate_up_proj) {
    const int64_t half = s.intermediate * s.t;
    plan.column_pieces(prefix + "gate_up_proj", mlp.gate_up_proj,
                       {part, {half + part.first, part.count}});
  } else {
    plan.column(prefix + "gate_proj", mlp.gate_proj, part.first, part.count, true, false);
    plan.column(prefix + "up_proj", mlp.up_proj, part.first, part.count, true, false);
  }
  plan.row(prefix + "down_proj", mlp.down_proj);
  plan.copy_first_input(mlp);
}

// The embedding vocab-parallel, the head column-parallel over the vocabulary (not gathered),
// the final norm replicated.
void split_ends(PlanBuilder& plan, const TpSplit& s, CausalLMImpl& model) {
  DecoderModelImpl& body = *model.model;
  plan.rows_of("model.embed_tokens.weight", body.embed_tokens->weight, s.r * s.vocab_part,
               s.vocab_part, true);
  tp::parallelize_vocab_embedding(*body.embed_tokens, s.tp, plan.counters());
  plan.replicated("model.norm.weight", body.norm->weight);
  if (model.lm_head) {
    plan.column("lm_head", model.lm_head, s.r * s.vocab_part, s.vocab_part, true, true);
    return;
  }
  // Tied: the head is at::linear(h, embed_tokens.weight) on this rank's vocabulary rows; the
  // final norm's output is its input, copied to the group there.
  nn::register_forward_hook(*body.norm, [tp = s.tp, counters = plan.counters()](
                                            torch::nn::Module&, nn::TensorRefs& outputs) {
    if (!outputs.empty()) *outputs.front() = tp::copy_to_group(*outputs.front(), tp, counters);
  });
}

}  // namespace

bool is_tensor_parallel_split(const CausalLM& model) {
  return model->model->embed_tokens->options.num_embeddings() != model->config.vocab_size;
}

std::shared_ptr<const TensorParallelPlan> parallelize(CausalLM& model, const ParallelState& state) {
  if (is_tensor_parallel_split(model)) {
    throw Error("mdist: hf::parallelize: the model is already split over a tensor-parallel group");
  }
  if (is_fsdp2_model(*model)) {
    throw Error(
        "mdist: hf::parallelize: the model is already wrapped by fully_shard; parallelize "
        "first, then fsdp2_wrap over the data-parallel group");
  }
  const Group tp = state.tensor_parallel_group.group();
  const int t = tp.is_not_used() ? 1 : size(tp);
  const LlamaConfig& c = model->config;
  check_tensor_parallel_split(c, t);
  if (t == 1) {
    return std::make_shared<const TensorParallelPlan>(
        tp, c.vocab_size, std::map<std::string, TensorParallelPlacement>{}, true);
  }
  const TpSplit split = split_of(c, tp, t);
  auto counters = std::make_shared<tp::CommCounters>();
  PlanBuilder plan(split, counters);
  split_ends(plan, split, *model);
  DecoderModelImpl& body = *model->model;
  for (std::size_t i = 0; i < body.decoder_layers.size(); ++i) {
    DecoderLayerImpl& layer = *body.decoder_layers[i];
    const std::string prefix = "model.layers." + std::to_string(i) + ".";
    split_attention(plan, split, *layer.self_attn, prefix + "self_attn.");
    split_mlp(plan, split, *layer.mlp, prefix + "mlp.");
    // Every layer norm acts on the whole hidden state: replicated (OLMo 2 has no input norm;
    // Gemma's sandwich and OLMo 2's post norms add the feed-forward ones).
    for (const auto& [name, norm] :
         {std::pair{"input_layernorm", layer.input_layernorm},
          std::pair{"post_attention_layernorm", layer.post_attention_layernorm},
          std::pair{"pre_feedforward_layernorm", layer.pre_feedforward_layernorm},
          std::pair{"post_feedforward_layernorm", layer.post_feedforward_layernorm}}) {
      if (norm) plan.replicated(prefix + name + ".weight", norm->weight);
    }
  }
  return std::make_shared<const TensorParallelPlan>(tp, c.vocab_size, std::move(plan.placements),
                                                    split.holds_rank0, std::move(counters));
}

}  // namespace mdist::hf
