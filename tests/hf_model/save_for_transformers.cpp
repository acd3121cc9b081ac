// Developer check (not run by CI): writes a seeded model with mdist's save_pretrained, plus
// its logits for fixed input ids, for check_transformers_loads.py to compare against
// transformers' from_pretrained of the same directory.
//   save_for_transformers FIXTURE_CONFIG_DIR OUT_DIR [LENGTH]
// LENGTH (default 8): the tokens per row of the two rows of ids; above a config's
// original_max_position_embeddings or sliding window, the long-context RoPE (dynamic, longrope)
// and the windows are part of the check.
#include <torch/torch.h>

#include <fstream>
#include <iostream>
#include <string>

#include "mdist/hf/pretrained.h"
#include "mdist/mdist.h"

int main(int argc, char** argv) {
  if (argc != 3 && argc != 4) {
    std::cerr << "usage: save_for_transformers FIXTURE_CONFIG_DIR OUT_DIR [LENGTH]" << std::endl;
    return 2;
  }
  return mdist::guarded_main(
      [](int count, char** args) {
        const auto config =
            mdist::hf::LlamaConfig::from_file(std::string(args[1]) + "/config.json");
        torch::manual_seed(123);
        mdist::hf::CausalLM model(config);
        mdist::hf::save_pretrained(model, args[2], /*max_shard_bytes=*/64 << 10);
        const int64_t length = count == 4 ? std::stoll(args[3]) : 8;
        if (length <= 0) throw mdist::Error("save_for_transformers: LENGTH must be positive");
        const at::Tensor ids =
            at::arange(2 * length, at::kLong).remainder(config.vocab_size).view({2, length});
        const at::NoGradGuard no_grad;
        const at::Tensor logits = model->forward(ids).contiguous();
        std::ofstream out(std::string(args[2]) + "/mdist_logits.bin", std::ios::binary);
        out.write(static_cast<const char*>(logits.data_ptr()),
                  static_cast<std::streamsize>(logits.nbytes()));
        return 0;
      },
      argc, argv);
}
