#include "src/hf/tokenizer/post_processor.h"

#include <unordered_map>

namespace mdist::hf::tok {
namespace {

class Template final : public PostProcessor {
 public:
  Template(const Json& j, const std::string& file) {
    std::unordered_map<std::string, std::vector<std::int32_t>> specials;
    for (const auto& [name, value] : j.at("special_tokens").items()) {
      specials[name] = value.at("ids").get<std::vector<std::int32_t>>();
    }
    bool has_sequence = false;
    for (const auto& piece : j.at("single")) {
      if (const auto it = piece.find("SpecialToken"); it != piece.end()) {
        const auto name = it->at("id").get<std::string>();
        const auto found = specials.find(name);
        if (found == specials.end()) {
          fail(file, "TemplateProcessing post-processor: special token '" + name +
                         "' is not in special_tokens");
        }
        (has_sequence ? suffix_ : prefix_)
            .insert((has_sequence ? suffix_ : prefix_).end(), found->second.begin(),
                    found->second.end());
      } else if (piece.contains("Sequence")) {
        if (has_sequence)
          fail(file, "TemplateProcessing post-processor: two sequences in 'single'");
        has_sequence = true;
      } else {
        fail(file, "TemplateProcessing post-processor: unknown piece " + piece.dump());
      }
    }
    if (!has_sequence) fail(file, "TemplateProcessing post-processor: no sequence in 'single'");
  }
  void process(std::vector<std::int32_t>& ids) const override {
    ids.insert(ids.begin(), prefix_.begin(), prefix_.end());
    ids.insert(ids.end(), suffix_.begin(), suffix_.end());
  }

 private:
  std::vector<std::int32_t> prefix_, suffix_;
};

class ClsSep final : public PostProcessor {
 public:
  explicit ClsSep(const Json& j)
      : cls_(j.at("cls").at(1).get<std::int32_t>()), sep_(j.at("sep").at(1).get<std::int32_t>()) {}
  void process(std::vector<std::int32_t>& ids) const override {
    ids.insert(ids.begin(), cls_);
    ids.push_back(sep_);
  }

 private:
  std::int32_t cls_, sep_;
};

class NoIds final : public PostProcessor {
 public:
  void process(std::vector<std::int32_t>&) const override {}
};

class Sequence final : public PostProcessor {
 public:
  explicit Sequence(std::vector<std::unique_ptr<PostProcessor>> steps) : steps_(std::move(steps)) {}
  void process(std::vector<std::int32_t>& ids) const override {
    for (const auto& step : steps_) step->process(ids);
  }

 private:
  std::vector<std::unique_ptr<PostProcessor>> steps_;
};

}  // namespace

std::unique_ptr<PostProcessor> load_post_processor(const Json& j, const std::string& file) {
  if (j.is_null()) return nullptr;
  const auto type = type_of(j, file, "post-processor");
  try {
    if (type == "TemplateProcessing") return std::make_unique<Template>(j, file);
    if (type == "ByteLevel") return std::make_unique<NoIds>();
    if (type == "RobertaProcessing" || type == "BertProcessing") return std::make_unique<ClsSep>(j);
    if (type == "Sequence") {
      std::vector<std::unique_ptr<PostProcessor>> steps;
      for (const auto& step : j.at("processors")) {
        auto loaded = load_post_processor(step, file);
        if (loaded) steps.push_back(std::move(loaded));
      }
      return std::make_unique<Sequence>(std::move(steps));
    }
  } catch (const Json::exception& e) {
    fail(file, "post-processor " + type + " is malformed: " + e.what());
  }
  fail(file, "unsupported post-processor type '" + type + "'");
}

}  // namespace mdist::hf::tok
