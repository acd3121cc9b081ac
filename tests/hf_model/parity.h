#pragma once
// The model side of the transformers parity tests (rope_test, family_test): a CausalLM holding
// a fixture's weights, and the logit error at real tokens.
#include <torch/torch.h>

#include <map>
#include <string>

#include "mdist/hf/causal_lm.h"
#include "mdist/hf/config.h"
#include "tests/hf_model/fixture_reader.h"

namespace mdist::test {

// A model of `config` in `dtype` with the fixture's weights, in eval mode.
inline hf::CausalLM loaded(const hf::LlamaConfig& config,
                           const std::map<std::string, at::Tensor>& fixture,
                           at::ScalarType dtype = at::kFloat) {
  hf::CausalLM model(config);
  model->to(dtype);
  hf::load_state_dict(model, weights_of(fixture));
  model->eval();
  return model;
}

// The largest |difference| of the logits from the fixture's at real (not padding) tokens.
inline double real_error(const at::Tensor& logits,
                         const std::map<std::string, at::Tensor>& fixture) {
  const at::Tensor real = fixture.at("attention_mask").to(at::kBool);
  return (logits.to(at::kFloat) - fixture.at("logits")).abs().index({real}).max().item<double>();
}

}  // namespace mdist::test
