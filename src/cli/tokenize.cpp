// `mdist tokenize`: a text or JSON Lines corpus to a binary token file (.u16 / .u32) with a
// model directory's tokenizer.json, split across the ranks by byte ranges cut at document
// boundaries. Each rank writes its documents' ids to a hidden part file next to the output;
// rank 0 then joins the parts in rank order into a hidden temporary file, fsyncs it and renames
// it into place. The output is therefore the same bytes whatever the number of ranks, appears
// whole or not at all, and an earlier output survives a failed run.
#include <fcntl.h>
#include <unistd.h>

#include <cerrno>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <random>

#include "mdist/hf/tokenizer.h"
#include "mdist/objects/collectives.h"
#include "mdist/runtime/runtime.h"
#include "src/cli/commands.h"
#include "src/cli/document_encoder.h"
#include "src/cli/documents.h"
#include "src/cli/job.h"
#include "src/cli/progress.h"

namespace mdist::cli {
namespace {

namespace fs = std::filesystem;

// Little-endian ids of one width into a file, buffered.
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
      buffer_.push_back(static_cast<unsigned char>(v >> 8));
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

// Appends the file `part` to the open descriptor `out`.
void append_file(int out, const fs::path& part) {
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
    for (ssize_t done = 0; done < n;) {
      const ssize_t w = ::write(out, buffer.data() + done, static_cast<std::size_t>(n - done));
      if (w < 0) {
        ::close(in);
        throw Error(std::string("cannot write the output: ") + std::strerror(errno));
      }
      done += w;
    }
  }
  ::close(in);
}

void fsync_dir(const fs::path& dir) {
  const int fd = ::open(dir.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC);
  if (fd >= 0) {
    (void)::fsync(fd);
    ::close(fd);
  }
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

}  // namespace

int run_tokenize(const TokenizeOptions& o) {
  const Session session(setup_options(o.timeout_s));
  const auto started = std::chrono::steady_clock::now();
  std::shared_ptr<const hf::Tokenizer> tokenizer;
  std::shared_ptr<const MappedFile> corpus;
  DocumentOptions documents;
  int width = 4;
  agree_on_inputs([&] {
    documents.format = parse_document_format(o.format);
    documents.sample_by = parse_sample_by(o.sample_by);
    documents.field = o.field;
    if (documents.format == DocumentFormat::jsonl && documents.sample_by != SampleBy::line) {
      throw InputError("--sample-by " + o.sample_by +
                       " is for --format text; jsonl has one "
                       "document per line");
    }
    if (documents.format == DocumentFormat::jsonl && o.field.empty()) {
      throw InputError("--field must name the JSON field holding the text");
    }
    const std::string ext = o.out.extension().string();
    if (ext != ".u16" && ext != ".u32") {
      throw InputError("--out '" + o.out.string() +
                       "': unknown extension (expected .u16 or .u32, little-endian ids)");
    }
    width = ext == ".u16" ? 2 : 4;
    const fs::path out_dir = o.out.has_parent_path() ? o.out.parent_path() : fs::path(".");
    std::error_code ec;
    if (!fs::is_directory(out_dir, ec)) {
      throw InputError("--out '" + o.out.string() + "': directory '" + out_dir.string() +
                       "' does not exist");
    }
    if (fs::is_directory(o.out, ec)) {
      throw InputError("--out '" + o.out.string() + "' is a directory");
    }
    check_writable_file(o.out, "output file");
    tokenizer = tokenizer_of(o.model_dir, /*required=*/true);
    corpus = std::make_shared<const MappedFile>(o.data, "data file");
    if (fs::equivalent(o.data, o.out, ec)) {
      throw InputError("--out '" + o.out.string() + "' is the --data file");
    }
    if (width == 2 && tokenizer->vocab_size() > 65536) {
      throw InputError("the tokenizer has " + std::to_string(tokenizer->vocab_size()) +
                       " tokens, more than .u16 holds (65536); use a .u32 --out");
    }
  });
  say("mdist tokenize: tokenizer: " + tokenizer->description());
  const DocumentEncoder encoder(*tokenizer);

  // Hidden names next to the output, unique to this job (rank 0 draws the tag).
  std::string tag;
  if (rank() == 0) tag = std::to_string(::getpid()) + "-" + std::to_string(std::random_device{}());
  tag = broadcast(tag);
  const fs::path out_dir = o.out.has_parent_path() ? o.out.parent_path() : fs::path(".");
  const auto part_path = [&](int r) {
    return out_dir /
           ("." + o.out.filename().string() + ".tmp-" + tag + ".part-" + std::to_string(r));
  };
  const fs::path temp = out_dir / ("." + o.out.filename().string() + ".tmp-" + tag);

  const auto [begin, end] = document_range(*corpus, rank(), size(), documents.sample_by);
  std::int64_t tokens = 0;
  std::int64_t count = 0;
  // Each rank's outcome: its own part written, or the first problem it met. The lowest rank's
  // problem is the first one in the file.
  std::optional<std::pair<int, std::string>> problem;
  try {
    IdWriter writer(part_path(rank()), width);
    PartProgress progress(end - begin);
    std::vector<std::int32_t> ids;
    const auto sink = [&](std::span<const std::int32_t> some) { writer.write(some); };
    for_each_document(*corpus, begin, end, documents, [&](std::string_view doc, std::size_t at) {
      if (documents.sample_by == SampleBy::document) {
        encoder.encode_long(doc, sink);
      } else {
        ids.clear();
        encoder.encode(doc, ids);
        sink(ids);
      }
      ++count;
      progress.update(at + doc.size() - begin, writer.count());
    });
    writer.close();
    progress.finish();
    tokens = writer.count();
  } catch (const InputError& error) {
    problem = {2, error.what()};
  } catch (const std::exception& error) {
    problem = {1, error.what()};
  }
  const auto outcomes = allgather(std::tuple{problem, tokens, count, peak_rss_mib()});
  for (const auto& [p, t, c, m] : outcomes) {
    if (!p) continue;
    remove_quietly(part_path(rank()));
    throw AgreedFailure(p->second, rank() == 0, p->first);
  }
  std::int64_t total = 0, documents_total = 0;
  std::string peaks;
  for (const auto& [p, t, c, m] : outcomes) {
    total += t;
    documents_total += c;
    char text[32];
    std::snprintf(text, sizeof(text), " %.0f", m);
    peaks += text;
  }

  // Rank 0 joins the parts (the directory is shared, as for checkpoints).
  std::optional<std::string> failure;
  if (rank() == 0) {
    int fd = -1;
    try {
      fd = ::open(temp.c_str(), O_WRONLY | O_CREAT | O_EXCL | O_CLOEXEC, 0644);
      if (fd < 0) throw Error("cannot create '" + temp.string() + "': " + std::strerror(errno));
      for (int r = 0; r < size(); ++r) append_file(fd, part_path(r));
      if (::fsync(fd) != 0)
        throw Error("cannot fsync '" + temp.string() + "': " + std::strerror(errno));
      ::close(fd);
      fd = -1;
      fs::rename(temp, o.out);
      fsync_dir(out_dir);
    } catch (const std::exception& error) {
      if (fd >= 0) ::close(fd);
      remove_quietly(temp);
      failure = error.what();
    }
  }
  barrier();
  remove_quietly(part_path(rank()));
  failure = broadcast(failure);
  if (failure) throw AgreedFailure(*failure, rank() == 0, 1);

  const double seconds =
      std::chrono::duration<double>(std::chrono::steady_clock::now() - started).count();
  char line[512];
  std::snprintf(line, sizeof(line),
                "mdist tokenize: wrote %s: %lld tokens (%s) from %lld documents, %zu bytes of "
                "%s on %d rank(s) in %.2f s (%.1f MB/s); peak RSS MiB%s",
                o.out.string().c_str(), static_cast<long long>(total), width == 2 ? "u16" : "u32",
                static_cast<long long>(documents_total), corpus->size(), o.data.string().c_str(),
                size(), seconds, static_cast<double>(corpus->size()) / seconds / 1e6,
                peaks.c_str());
  say(line);
  return 0;
}

}  // namespace mdist::cli
