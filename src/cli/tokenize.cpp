// `mdist tokenize`: a text or JSON Lines corpus to a binary token file (.u16 / .u32) with a
// model directory's tokenizer.json, split across the ranks by byte ranges cut at document
// boundaries. Each rank writes its documents' ids to a hidden part file next to the output;
// rank 0 then joins the parts in rank order into the output through mdist::io::AtomicFile (a
// hidden temporary file, fsynced and renamed into place). The output is therefore the same bytes
// whatever the number of ranks, appears whole or not at all, and an earlier output survives a
// failed run.
//
// --format sft writes the examples of a prompt / completion JSON Lines file (src/cli/
// sft_token_file.h): the ids, and beside them OUT.mask, one byte a token, through the same
// parts and the same join.
#include <fcntl.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <memory>
#include <random>
#include <vector>

#include "mdist/hf/tokenizer.h"
#include "mdist/io/atomic_file.h"
#include "mdist/objects/collectives.h"
#include "mdist/runtime/runtime.h"
#include "src/cli/commands.h"
#include "src/cli/document_encoder.h"
#include "src/cli/documents.h"
#include "src/cli/job.h"
#include "src/cli/progress.h"
#include "src/cli/sft_examples.h"
#include "src/cli/sft_token_file.h"

namespace mdist::cli {
namespace {

namespace fs = std::filesystem;

// Little-endian ids of one width (1, 2 or 4 bytes) into a file, buffered. Width 1 writes the
// low byte: an SFT loss mask.
class IdWriter {
 public:
  IdWriter(const fs::path& path, int width) : path_(path), width_(width) {
    file_ = std::fopen(path.c_str(), "wbx");
    if (file_ == nullptr) fail("cannot create");
  }
  ~IdWriter() {
    if (file_ != nullptr) std::fclose(file_);
  }
  IdWriter(const IdWriter&) = delete;
  IdWriter& operator=(const IdWriter&) = delete;

  void write(std::span<const std::int32_t> ids) {
    buffer_.clear();
    for (const std::int32_t id : ids) {
      const auto v = static_cast<std::uint32_t>(id);
      buffer_.push_back(static_cast<unsigned char>(v));
      if (width_ >= 2) buffer_.push_back(static_cast<unsigned char>(v >> 8));
      if (width_ == 4) {
        buffer_.push_back(static_cast<unsigned char>(v >> 16));
        buffer_.push_back(static_cast<unsigned char>(v >> 24));
      }
    }
    if (!buffer_.empty() &&
        std::fwrite(buffer_.data(), 1, buffer_.size(), file_) != buffer_.size()) {
      fail("cannot write");
    }
    count_ += static_cast<std::int64_t>(ids.size());
  }
  void close() {
    const bool ok = std::fflush(file_) == 0;
    std::fclose(file_);
    file_ = nullptr;
    if (!ok) fail("cannot write");
  }
  std::int64_t count() const { return count_; }

 private:
  [[noreturn]] void fail(const char* what) const {
    throw Error(std::string(what) + " '" + path_.string() + "': " + std::strerror(errno));
  }
  fs::path path_;
  int width_;
  std::FILE* file_ = nullptr;
  std::vector<unsigned char> buffer_;
  std::int64_t count_ = 0;
};

// Appends the file `part` to `out`.
void append_file(io::AtomicFile& out, const fs::path& part) {
  const int in = ::open(part.c_str(), O_RDONLY | O_CLOEXEC);
  if (in < 0) throw Error("cannot read '" + part.string() + "': " + std::strerror(errno));
  std::vector<char> buffer(std::size_t{4} << 20);
  while (true) {
    const ssize_t n = ::read(in, buffer.data(), buffer.size());
    if (n < 0) {
      ::close(in);
      throw Error("cannot read '" + part.string() + "': " + std::strerror(errno));
    }
    if (n == 0) break;
    try {
      out.write(buffer.data(), static_cast<std::size_t>(n));
    } catch (...) {
      ::close(in);
      throw;
    }
  }
  ::close(in);
}

// The output's failures in the words `mdist tokenize` has always used (a failed rename in those
// of std::filesystem::rename).
std::string output_failure(const io::FileError& e) {
  const std::string reason = std::strerror(e.error_number());
  if (e.operation() == "write") return "cannot write the output: " + reason;
  if (e.operation() == "rename") {
    return "filesystem error: cannot rename: " + reason + " [" + e.path().string() + "] [" +
           e.target().string() + "]";
  }
  const std::string verb = e.operation() == "create temporary file" ? "create" : e.operation();
  return "cannot " + verb + " '" + e.path().string() + "': " + reason;
}

// Removes `path` if it exists; never throws (cleanup on the way out of an error).
void remove_quietly(const fs::path& path) {
  std::error_code ec;
  fs::remove(path, ec);
}

// Rank 0's progress over its own part, redrawn in place on a terminal (nothing otherwise).
class PartProgress {
 public:
  explicit PartProgress(std::size_t bytes) : bytes_(bytes) {
    const char* forced = std::getenv("MDIST_STDOUT_IS_TTY");
    terminal_ = rank() == 0 &&
                (forced != nullptr ? std::strcmp(forced, "1") == 0 : isatty(fileno(stdout)) == 1);
  }
  void update(std::size_t done, std::int64_t tokens) {
    if (!terminal_) return;
    const auto now = std::chrono::steady_clock::now();
    if (now - last_ < std::chrono::milliseconds(200)) return;
    last_ = now;
    const double s = std::chrono::duration<double>(now - start_).count();
    const double fraction =
        bytes_ > 0 ? static_cast<double>(done) / static_cast<double>(bytes_) : 1;
    std::printf("mdist tokenize: rank 0 %3.0f%% of its part | %lld tokens | %.1f MB/s\x1b[K\r",
                fraction * 100, static_cast<long long>(tokens),
                s > 0 ? static_cast<double>(done) / s / 1e6 : 0.0);
    std::fflush(stdout);
    drawn_ = true;
  }
  void finish() {
    if (drawn_) std::printf("\n");
    drawn_ = false;
  }

 private:
  std::size_t bytes_;
  bool terminal_ = false;
  bool drawn_ = false;
  std::chrono::steady_clock::time_point start_ = std::chrono::steady_clock::now();
  std::chrono::steady_clock::time_point last_{};
};

// What `mdist tokenize` reads, checked alike on every rank.
struct TokenizeInputs {
  DocumentOptions documents;
  bool sft = false;  // --format sft: prompt / completion examples, with a loss mask
  std::string prompt_field, completion_field;
  int width = 4;  // bytes per id in the output
  std::shared_ptr<const hf::Tokenizer> tokenizer;
  std::shared_ptr<const MappedFile> corpus;
};

// The flags, the output path, the tokenizer and the corpus; throws InputError.
TokenizeInputs read_inputs(const TokenizeOptions& o) {
  TokenizeInputs in;
  in.sft = o.format == "sft";
  if (in.sft) {
    if (o.field != "text") {
      throw InputError(
          "--field is for --format jsonl; --format sft reads --prompt-field and "
          "--completion-field");
    }
    if (o.prompt_field.empty() || o.completion_field.empty()) {
      throw InputError("--prompt-field and --completion-field must not be empty");
    }
    in.prompt_field = o.prompt_field;
    in.completion_field = o.completion_field;
  } else if (o.prompt_field != "prompt" || o.completion_field != "completion") {
    throw InputError("--prompt-field and --completion-field need --format sft");
  }
  // An SFT file is JSON Lines, one example a line: split across the ranks by lines.
  in.documents.format = in.sft ? DocumentFormat::jsonl : parse_document_format(o.format);
  in.documents.sample_by = parse_sample_by(o.sample_by);
  in.documents.field = o.field;
  if (in.documents.format == DocumentFormat::jsonl && in.documents.sample_by != SampleBy::line) {
    throw InputError("--sample-by " + o.sample_by +
                     " is for --format text; jsonl has one "
                     "document per line");
  }
  if (in.documents.format == DocumentFormat::jsonl && o.field.empty()) {
    throw InputError("--field must name the JSON field holding the text");
  }
  const std::string ext = o.out.extension().string();
  if (ext != ".u16" && ext != ".u32") {
    throw InputError("--out '" + o.out.string() +
                     "': unknown extension (expected .u16 or .u32, little-endian ids)");
  }
  in.width = ext == ".u16" ? 2 : 4;
  const fs::path out_dir = o.out.has_parent_path() ? o.out.parent_path() : fs::path(".");
  std::error_code ec;
  if (!fs::is_directory(out_dir, ec)) {
    throw InputError("--out '" + o.out.string() + "': directory '" + out_dir.string() +
                     "' does not exist");
  }
  if (fs::is_directory(o.out, ec))
    throw InputError("--out '" + o.out.string() + "' is a directory");
  check_writable_file(o.out, "output file");
  if (in.sft && fs::is_directory(sft_mask_path(o.out), ec)) {
    throw InputError("--out '" + o.out.string() + "': its loss-mask file '" +
                     sft_mask_path(o.out).string() + "' is a directory");
  }
  in.tokenizer = tokenizer_of(o.model_dir, /*required=*/true);
  in.corpus = std::make_shared<const MappedFile>(o.data, "data file");
  if (fs::equivalent(o.data, o.out, ec)) {
    throw InputError("--out '" + o.out.string() + "' is the --data file");
  }
  if (in.sft && fs::equivalent(o.data, sft_mask_path(o.out), ec)) {
    throw InputError("--out '" + o.out.string() + "': its loss-mask file is the --data file");
  }
  if (in.width == 2 && in.tokenizer->vocab_size() > 65536) {
    throw InputError("the tokenizer has " + std::to_string(in.tokenizer->vocab_size()) +
                     " tokens, more than .u16 holds (65536); use a .u32 --out");
  }
  return in;
}

// The ranks' hidden part files next to the output, named with a tag unique to this job (rank 0
// draws it; collective).
class PartFiles {
 public:
  explicit PartFiles(const fs::path& out) : out_(out) {
    if (rank() == 0)
      tag_ = std::to_string(::getpid()) + "-" + std::to_string(std::random_device{}());
    tag_ = broadcast(tag_);
  }
  fs::path of(int r) const {
    const fs::path dir = out_.has_parent_path() ? out_.parent_path() : fs::path(".");
    return dir / ("." + out_.filename().string() + ".tmp-" + tag_ + ".part-" + std::to_string(r));
  }

 private:
  fs::path out_;
  std::string tag_;
};

// One rank's share of the work: its part written, or the first problem it met (exit code and
// message).
struct PartOutcome {
  std::optional<std::pair<int, std::string>> problem;
  std::int64_t tokens = 0;
  std::int64_t documents = 0;
  std::int64_t completion_tokens = 0;  // sft
};

// The number of the line that starts at `offset` (1 for the first), counted in chunks whose
// pages are handed back.
std::int64_t line_number_at(const io::MappedFile& file, std::size_t offset) {
  constexpr std::size_t kChunk = std::size_t{1} << 24;
  const auto* base = reinterpret_cast<const char*>(file.data());
  std::int64_t lines = 1;
  for (std::size_t at = 0; at < offset; at += kChunk) {
    const std::size_t n = std::min(kChunk, offset - at);
    lines += std::count(base + at, base + at + n, '\n');
    file.release(at, n);
  }
  return lines;
}

// The prompt / completion examples of the lines that start in [begin, end) (line boundaries)
// into the part files `path` (ids) and `mask_path` (one mask byte an id).
PartOutcome write_sft_part(const TokenizeInputs& in, const fs::path& path,
                           const fs::path& mask_path, std::size_t begin, std::size_t end) {
  PartOutcome outcome;
  try {
    IdWriter writer(path, in.width);
    IdWriter mask_writer(mask_path, 1);
    PartProgress progress(end - begin);
    const io::MappedFile& file = *in.corpus;
    const auto* base = reinterpret_cast<const char*>(file.data());
    std::int64_t number = line_number_at(file, begin);
    std::vector<std::int32_t> mask;
    std::size_t released = begin;
    for (std::size_t at = begin; at < end; ++number) {
      const void* nl = std::memchr(base + at, '\n', end - at);
      const std::size_t stop =
          nl == nullptr ? end : static_cast<std::size_t>(static_cast<const char*>(nl) - base);
      const std::string where =
          "data file '" + file.path().string() + "' line " + std::to_string(number);
      const std::optional<SftExample> example =
          sft_example_of_line(std::string_view(base + at, stop - at), *in.tokenizer,
                              in.prompt_field, in.completion_field, where);
      at = stop + 1;
      if (example) {
        mask.assign(example->ids.size(), 0);
        for (std::size_t i = 0; i < mask.size(); ++i) {
          if (static_cast<std::int64_t>(i) >= example->prompt_tokens) mask[i] = kSftLoss;
        }
        mask[0] |= kSftExampleStart;
        writer.write(example->ids);
        mask_writer.write(mask);
        ++outcome.documents;
        outcome.completion_tokens +=
            static_cast<std::int64_t>(example->ids.size()) - example->prompt_tokens;
      }
      const std::size_t passed = std::min(at, end);
      if (passed - released >= (std::size_t{1} << 24)) {
        file.release(released, passed - released);
        released = passed;
      }
      progress.update(passed - begin, writer.count());
    }
    writer.close();
    mask_writer.close();
    progress.finish();
    outcome.tokens = writer.count();
  } catch (const InputError& error) {
    outcome.problem = {2, error.what()};
  } catch (const std::exception& error) {
    outcome.problem = {1, error.what()};
  }
  return outcome;
}

// Encodes the documents that start in [begin, end) into the part file `path`.
PartOutcome write_part(const TokenizeInputs& in, const fs::path& path, std::size_t begin,
                       std::size_t end) {
  PartOutcome outcome;
  const DocumentEncoder encoder(*in.tokenizer);
  try {
    IdWriter writer(path, in.width);
    PartProgress progress(end - begin);
    std::vector<std::int32_t> ids;
    const auto sink = [&](std::span<const std::int32_t> some) { writer.write(some); };
    for_each_document(*in.corpus, begin, end, in.documents,
                      [&](std::string_view doc, std::size_t at) {
                        if (in.documents.sample_by == SampleBy::document) {
                          encoder.encode_long(doc, sink);
                        } else {
                          ids.clear();
                          encoder.encode(doc, ids);
                          sink(ids);
                        }
                        ++outcome.documents;
                        progress.update(at + doc.size() - begin, writer.count());
                      });
    writer.close();
    progress.finish();
    outcome.tokens = writer.count();
  } catch (const InputError& error) {
    outcome.problem = {2, error.what()};
  } catch (const std::exception& error) {
    outcome.problem = {1, error.what()};
  }
  return outcome;
}

// The job's totals, once every rank has written its part.
struct Totals {
  std::int64_t tokens = 0;
  std::int64_t documents = 0;
  std::int64_t completion_tokens = 0;
  std::string peaks;  // " MiB MiB ...", one a rank
};

// Gathers every rank's outcome (collective). The lowest rank's problem is the first one in the
// file: every rank removes its parts and throws it.
Totals agree_on_parts(const PartOutcome& mine, const std::vector<PartFiles>& parts) {
  const auto outcomes = allgather(std::tuple{mine.problem, mine.tokens, mine.documents,
                                             mine.completion_tokens, peak_rss_mib()});
  for (const auto& [p, t, c, l, m] : outcomes) {
    if (!p) continue;
    for (const PartFiles& part : parts) remove_quietly(part.of(rank()));
    throw AgreedFailure(p->second, rank() == 0, p->first);
  }
  Totals totals;
  for (const auto& [p, t, c, l, m] : outcomes) {
    totals.tokens += t;
    totals.documents += c;
    totals.completion_tokens += l;
    char text[32];
    std::snprintf(text, sizeof(text), " %.0f", m);
    totals.peaks += text;
  }
  return totals;
}

// Rank 0 joins the parts in rank order into the outputs (parts[i] into outs[i]), atomically (the
// directory is shared, as for checkpoints). Every output is written and synced before any is
// renamed into place, the last output last: only a failed rename between two leaves a new file
// beside an old one (an SFT mask beside its old ids, which training refuses by their lengths).
// Returns the failure, if any.
std::optional<std::string> join_parts(const std::vector<PartFiles>& parts,
                                      const std::vector<fs::path>& outs) {
  try {
    std::vector<std::unique_ptr<io::AtomicFile>> files;
    for (std::size_t i = 0; i < outs.size(); ++i) {
      files.push_back(std::make_unique<io::AtomicFile>(outs[i]));
      for (int r = 0; r < size(); ++r) append_file(*files.back(), parts[i].of(r));
    }
    for (auto it = files.rbegin(); it != files.rend(); ++it) (*it)->commit();
  } catch (const io::FileError& error) {
    return output_failure(error);
  } catch (const std::exception& error) {
    return error.what();
  }
  return std::nullopt;
}

}  // namespace

int run_tokenize(const TokenizeOptions& o) {
  const Session session(setup_options(o.timeout_s));
  const auto started = std::chrono::steady_clock::now();
  TokenizeInputs in;
  agree_on_inputs([&] { in = read_inputs(o); });
  say("mdist tokenize: tokenizer: " + in.tokenizer->description());

  // The outputs: the ids and, for sft, the mask beside them (renamed into place first).
  std::vector<fs::path> outs = {o.out};
  if (in.sft) outs.push_back(sft_mask_path(o.out));
  std::vector<PartFiles> parts;
  for (const fs::path& out : outs) parts.emplace_back(out);
  const auto [begin, end] = document_range(*in.corpus, rank(), size(), in.documents.sample_by);
  const PartOutcome mine =
      in.sft ? write_sft_part(in, parts[0].of(rank()), parts[1].of(rank()), begin, end)
             : write_part(in, parts[0].of(rank()), begin, end);
  const Totals totals = agree_on_parts(mine, parts);
  if (in.sft && totals.documents == 0) {
    for (const PartFiles& part : parts) remove_quietly(part.of(rank()));
    throw AgreedFailure("data file '" + o.data.string() + "' holds no example", rank() == 0, 2);
  }

  std::optional<std::string> failure;
  if (rank() == 0) failure = join_parts(parts, outs);
  barrier();
  for (const PartFiles& part : parts) remove_quietly(part.of(rank()));
  failure = broadcast(failure);
  if (failure) throw AgreedFailure(*failure, rank() == 0, 1);

  const double seconds =
      std::chrono::duration<double>(std::chrono::steady_clock::now() - started).count();
  const std::size_t bytes = in.corpus->size();
  std::string what = std::to_string(totals.documents) + " documents";
  if (in.sft) {
    what = std::to_string(totals.documents) + " examples (" +
           std::to_string(totals.completion_tokens) + " completion tokens; loss mask " +
           outs[1].string() + ")";
  }
  char line[1024];
  std::snprintf(line, sizeof(line),
                "mdist tokenize: wrote %s: %lld tokens (%s) from %s, %zu bytes of "
                "%s on %d rank(s) in %.2f s (%.1f MB/s); peak RSS MiB%s",
                o.out.string().c_str(), static_cast<long long>(totals.tokens),
                in.width == 2 ? "u16" : "u32", what.c_str(), bytes, o.data.string().c_str(), size(),
                seconds, static_cast<double>(bytes) / seconds / 1e6, totals.peaks.c_str());
  say(line);
  return 0;
}

}  // namespace mdist::cli
