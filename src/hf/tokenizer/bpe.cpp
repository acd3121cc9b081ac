#include "src/hf/tokenizer/bpe.h"

#include <cstdio>
#include <mutex>
#include <queue>

#include "src/hf/tokenizer/unicode.h"

namespace mdist::hf::tok {
namespace {

// A merge that splits into (a, b): the "a b" string form or the [a, b] pair form.
std::pair<std::string, std::string> parse_merge(const Json& m, const std::string& file) {
  if (m.is_string()) {
    const auto s = m.get<std::string>();
    const auto space = s.find(' ');
    if (space == std::string::npos || s.find(' ', space + 1) != std::string::npos) {
      fail(file, "BPE model: merge '" + s + "' is not two tokens separated by a space");
    }
    return {s.substr(0, space), s.substr(space + 1)};
  }
  if (m.is_array() && m.size() == 2 && m[0].is_string() && m[1].is_string()) {
    return {m[0].get<std::string>(), m[1].get<std::string>()};
  }
  fail(file, "BPE model: malformed merge " + m.dump());
}

std::string optional_string(const Json& model, const char* key) {
  const auto it = model.find(key);
  return it == model.end() || it->is_null() ? std::string() : it->get<std::string>();
}

}  // namespace

Bpe::Bpe(const Json& model, const std::string& file) {
  if (const auto it = model.find("dropout");
      it != model.end() && !it->is_null() && it->get<double>() != 0.0) {
    fail(file, "BPE dropout is not supported (it makes encoding random)");
  }
  const auto& vocab = model.at("vocab");
  if (!vocab.is_object()) fail(file, "BPE model: vocab is not an object");
  std::int32_t max_id = -1;
  for (const auto& [token, id] : vocab.items()) {
    const auto value = id.get<std::int32_t>();
    if (value < 0) fail(file, "BPE model: negative id for token '" + token + "'");
    vocab_.emplace(token, value);
    max_id = std::max(max_id, value);
  }
  id_to_token_.assign(static_cast<std::size_t>(max_id + 1), nullptr);
  for (const auto& [token, id] : vocab_) id_to_token_[static_cast<std::size_t>(id)] = &token;

  continuing_subword_prefix_ = optional_string(model, "continuing_subword_prefix");
  end_of_word_suffix_ = optional_string(model, "end_of_word_suffix");
  fuse_unk_ = model.value("fuse_unk", false);
  byte_fallback_ = model.value("byte_fallback", false);
  ignore_merges_ = model.value("ignore_merges", false);
  if (const auto unk = optional_string(model, "unk_token"); !unk.empty()) {
    const auto it = vocab_.find(unk);
    if (it == vocab_.end()) fail(file, "BPE model: unk_token '" + unk + "' is not in the vocab");
    unk_id_ = it->second;
  }
  for (int b = 0; b < 256; ++b) {
    char name[8];
    std::snprintf(name, sizeof name, "<0x%02X>", b);
    const auto it = vocab_.find(std::string_view(name));
    byte_ids_[b] = it == vocab_.end() ? -1 : it->second;
  }

  in_merge_.assign(id_to_token_.size(), 0);
  const auto& merges = model.at("merges");
  merges_.reserve(merges.size() * 2);
  std::int32_t rank = 0;
  for (const auto& m : merges) {
    const auto [a, b] = parse_merge(m, file);
    const auto ia = vocab_.find(a), ib = vocab_.find(b);
    if (ia == vocab_.end() || ib == vocab_.end()) {
      fail(file, "BPE model: merge '" + a + " " + b + "' uses a token that is not in the vocab");
    }
    std::string merged = a;
    if (!continuing_subword_prefix_.empty() && b.starts_with(continuing_subword_prefix_)) {
      merged.append(b, continuing_subword_prefix_.size());
    } else {
      merged.append(b);
    }
    const auto im = vocab_.find(merged);
    if (im == vocab_.end())
      fail(file, "BPE model: merged token '" + merged + "' is not in the vocab");
    // Like tokenizers' HashMap collect, a repeated pair keeps its last rank.
    merges_[pair_key(ia->second, ib->second)] = Merge{rank++, im->second};
    in_merge_[static_cast<std::size_t>(ia->second)] = 1;
    in_merge_[static_cast<std::size_t>(ib->second)] = 1;
  }
}

std::optional<std::int32_t> Bpe::token_to_id(std::string_view token) const {
  const auto it = vocab_.find(token);
  if (it == vocab_.end()) return std::nullopt;
  return it->second;
}

const std::string* Bpe::id_to_token(std::int32_t id) const {
  if (id < 0 || static_cast<std::size_t>(id) >= id_to_token_.size()) return nullptr;
  return id_to_token_[static_cast<std::size_t>(id)];
}

bool Bpe::is_merge_barrier(std::string_view ch) const {
  std::vector<std::int32_t> ids;
  initial_symbols(ch, ids);
  for (const auto id : ids) {
    if (in_merge_[static_cast<std::size_t>(id)]) return false;
  }
  // A character that becomes <unk> could fuse with a neighbouring unknown one.
  return !(unk_id_ && fuse_unk_ && !ids.empty() && ids.back() == *unk_id_);
}

// One symbol per character (with the subword prefix/suffix), byte tokens for characters
// outside the vocab when byte_fallback is set, else <unk> (fused when fuse_unk is set): the
// order of tokenizers' BPE::merge_word, including that a pending <unk> is only flushed by a
// character found in the vocab.
void Bpe::initial_symbols(std::string_view word, std::vector<std::int32_t>& ids) const {
  std::int32_t pending_unk = -1;
  std::string decorated;
  std::size_t i = 0;
  while (i < word.size()) {
    const std::size_t begin = i;
    i += static_cast<std::size_t>(utf8_length(static_cast<unsigned char>(word[i])));
    std::string_view ch = word.substr(begin, i - begin);
    if ((begin > 0 && !continuing_subword_prefix_.empty()) ||
        (i >= word.size() && !end_of_word_suffix_.empty())) {
      decorated.clear();
      if (begin > 0) decorated.append(continuing_subword_prefix_);
      decorated.append(ch);
      if (i >= word.size()) decorated.append(end_of_word_suffix_);
      ch = decorated;
    }
    if (const auto it = vocab_.find(ch); it != vocab_.end()) {
      if (pending_unk >= 0) {
        ids.push_back(pending_unk);
        pending_unk = -1;
      }
      ids.push_back(it->second);
      continue;
    }
    if (byte_fallback_) {
      bool all = true;
      for (const char c : ch) all = all && byte_ids_[static_cast<unsigned char>(c)] >= 0;
      if (all) {
        for (const char c : ch) ids.push_back(byte_ids_[static_cast<unsigned char>(c)]);
        continue;
      }
    }
    if (unk_id_) {
      if (pending_unk >= 0 && !fuse_unk_) ids.push_back(pending_unk);
      pending_unk = *unk_id_;
    }
  }
  if (pending_unk >= 0) ids.push_back(pending_unk);
}

// Applies merges lowest rank first, leftmost first among equal ranks, over a linked list of
// symbols with a binary heap of candidate pairs (stale entries are skipped when popped).
void Bpe::merge(std::vector<std::int32_t>& ids) const {
  const auto n = ids.size();
  if (n < 2 || merges_.empty()) return;
  struct Candidate {
    std::int32_t rank;
    std::int32_t pos;
    std::int32_t new_id;
    bool operator<(const Candidate& o) const {
      return rank != o.rank ? rank > o.rank : pos > o.pos;  // min-heap on (rank, pos)
    }
  };
  thread_local std::vector<std::int32_t> prev, next;
  thread_local std::vector<Candidate> heap_storage;
  prev.resize(n);
  next.resize(n);
  heap_storage.clear();
  for (std::size_t k = 0; k < n; ++k) {
    prev[k] = static_cast<std::int32_t>(k) - 1;
    next[k] = k + 1 < n ? static_cast<std::int32_t>(k + 1) : -1;
  }
  std::priority_queue<Candidate, std::vector<Candidate>> heap({}, std::move(heap_storage));
  auto push = [&](std::int32_t pos) {
    const auto right = next[static_cast<std::size_t>(pos)];
    if (right < 0) return;
    const auto it = merges_.find(
        pair_key(ids[static_cast<std::size_t>(pos)], ids[static_cast<std::size_t>(right)]));
    if (it != merges_.end()) heap.push({it->second.rank, pos, it->second.new_id});
  };
  for (std::size_t k = 0; k + 1 < n; ++k) push(static_cast<std::int32_t>(k));
  constexpr std::int32_t kGone = -2;
  while (!heap.empty()) {
    const auto top = heap.top();
    heap.pop();
    const auto pos = static_cast<std::size_t>(top.pos);
    if (ids[pos] == kGone) continue;
    const auto right = next[pos];
    if (right < 0) continue;
    const auto it = merges_.find(pair_key(ids[pos], ids[static_cast<std::size_t>(right)]));
    if (it == merges_.end() || it->second.new_id != top.new_id || it->second.rank != top.rank)
      continue;
    ids[pos] = top.new_id;
    ids[static_cast<std::size_t>(right)] = kGone;
    next[pos] = next[static_cast<std::size_t>(right)];
    if (next[pos] >= 0) prev[static_cast<std::size_t>(next[pos])] = top.pos;
    if (prev[pos] >= 0) push(prev[pos]);
    push(top.pos);
  }
  std::size_t w = 0;
  for (std::size_t k = 0; k < n; ++k) {
    if (ids[k] != kGone) ids[w++] = ids[k];
  }
  ids.resize(w);
}

void Bpe::tokenize(std::string_view word, std::vector<std::int32_t>& out) const {
  if (word.empty()) return;
  if (ignore_merges_) {
    if (const auto it = vocab_.find(word); it != vocab_.end()) {
      out.push_back(it->second);
      return;
    }
  }
  const bool cacheable = word.size() < kMaxCachedWord;
  if (cacheable) {
    const std::shared_lock lock(cache_mutex_);
    if (const auto it = cache_.find(word); it != cache_.end()) {
      out.insert(out.end(), it->second.begin(), it->second.end());
      return;
    }
  }
  thread_local std::vector<std::int32_t> ids;
  ids.clear();
  initial_symbols(word, ids);
  merge(ids);
  out.insert(out.end(), ids.begin(), ids.end());
  if (cacheable) {
    const std::unique_lock lock(cache_mutex_);
    if (cache_.size() >= kCacheCapacity) cache_.clear();
    cache_.emplace(std::string(word), ids);
  }
}

}  // namespace mdist::hf::tok
