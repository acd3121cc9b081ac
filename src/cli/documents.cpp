#include "src/cli/documents.h"

#include <algorithm>
#include <cstring>

#include <nlohmann/json.hpp>

#include "src/cli/input_error.h"

namespace mdist::cli {
namespace {

// Pages behind the reader are released in steps of this many bytes.
constexpr std::size_t kReleaseStep = std::size_t{8} << 20;

// 1-based number of the line that starts at `offset` (only computed for a message).
std::size_t line_number(const io::MappedFile& file, std::size_t offset) {
  std::size_t lines = 1;
  for (std::size_t at = 0; at < offset; at += kReleaseStep) {
    const std::size_t n = std::min(kReleaseStep, offset - at);
    lines += static_cast<std::size_t>(
        std::count(file.data() + at, file.data() + at + n, static_cast<unsigned char>('\n')));
    file.release(at, n);
  }
  return lines;
}

// `path` mapped, or the InputError of the command's message.
io::MappedFile map_input_file(const std::filesystem::path& path, const char* what) {
  std::error_code ec;
  if (!std::filesystem::exists(path, ec)) {
    throw InputError(std::string(what) + " '" + path.string() + "' does not exist");
  }
  if (std::filesystem::is_directory(path, ec)) {
    throw InputError(std::string(what) + " '" + path.string() + "' is a directory");
  }
  try {
    return io::MappedFile(path);
  } catch (const io::FileError& e) {
    throw InputError(std::string(e.operation() == "mmap" ? "cannot map " : "cannot read ") + what +
                     " '" + path.string() + "': " + std::strerror(e.error_number()));
  }
}

}  // namespace

MappedFile::MappedFile(const std::filesystem::path& path, const char* what)
    : io::MappedFile(map_input_file(path, what)) {}

DocumentFormat parse_document_format(const std::string& name) {
  if (name == "text") return DocumentFormat::text;
  if (name == "jsonl") return DocumentFormat::jsonl;
  throw InputError("unknown --format '" + name + "' (expected text or jsonl)");
}

SampleBy parse_sample_by(const std::string& name) {
  if (name == "line") return SampleBy::line;
  if (name == "paragraph") return SampleBy::paragraph;
  if (name == "document") return SampleBy::document;
  throw InputError("unknown --sample-by '" + name + "' (expected line, paragraph or document)");
}

std::size_t next_boundary(const io::MappedFile& file, std::size_t offset, SampleBy sample_by) {
  const std::size_t size = file.size();
  if (offset == 0 || offset >= size || sample_by == SampleBy::document) {
    return offset == 0 ? 0 : size;
  }
  const auto* data = file.data();
  for (std::size_t p = offset; p < size; ++p) {
    if (sample_by == SampleBy::line ? data[p - 1] == '\n'
                                    : p >= 2 && data[p - 1] == '\n' && data[p - 2] == '\n') {
      return p;
    }
  }
  return size;
}

std::pair<std::size_t, std::size_t> document_range(const io::MappedFile& file, int index, int count,
                                                   SampleBy sample_by) {
  const auto cut = [&](int i) {
    // size * i / count without overflow: size = q * count + r.
    const auto n = static_cast<std::size_t>(count);
    const auto k = static_cast<std::size_t>(i);
    const std::size_t offset = file.size() / n * k + file.size() % n * k / n;
    return next_boundary(file, offset, sample_by);
  };
  return {cut(index), cut(index + 1)};
}

void for_each_document(const io::MappedFile& file, std::size_t begin, std::size_t end,
                       const DocumentOptions& options,
                       const std::function<void(std::string_view, std::size_t)>& fn) {
  const auto* base = reinterpret_cast<const char*>(file.data());
  std::size_t released = begin;
  const auto release_behind = [&](std::size_t offset) {
    if (offset - released >= kReleaseStep) {
      file.release(released, offset - released);
      released = offset;
    }
  };
  const auto line_end = [&](std::size_t from) {
    const void* nl = std::memchr(base + from, '\n', end - from);
    return nl == nullptr ? end : static_cast<std::size_t>(static_cast<const char*>(nl) - base);
  };
  if (options.format == DocumentFormat::text && options.sample_by == SampleBy::document) {
    if (end > begin) fn(std::string_view(base + begin, end - begin), begin);
    file.release(begin, end - begin);
    return;
  }
  std::size_t paragraph_start = std::string_view::npos;
  std::size_t paragraph_end = 0;
  for (std::size_t at = begin; at < end;) {
    const std::size_t stop = line_end(at);
    std::size_t length = stop - at;
    const bool empty = length == 0;
    if (options.format == DocumentFormat::text && options.sample_by == SampleBy::paragraph) {
      // Lines are joined as they stand in the file (with their '\n'): a paragraph is the bytes
      // from its first line's start to its last line's end.
      if (!empty) {
        if (paragraph_start == std::string_view::npos) paragraph_start = at;
        paragraph_end = stop;
      } else if (paragraph_start != std::string_view::npos) {
        fn(std::string_view(base + paragraph_start, paragraph_end - paragraph_start),
           paragraph_start);
        paragraph_start = std::string_view::npos;
      }
    } else {
      if (length > 0 && base[at + length - 1] == '\r') --length;
      const std::string_view line(base + at, length);
      if (options.format == DocumentFormat::text) {
        if (!line.empty()) fn(line, at);
      } else if (line.find_first_not_of(" \t") != std::string_view::npos) {
        const auto json = nlohmann::json::parse(line, nullptr, false);
        const auto where = [&] {
          return "'" + file.path().string() + "' line " + std::to_string(line_number(file, at));
        };
        if (json.is_discarded()) throw InputError(where() + " is not JSON");
        if (!json.is_object() || !json.contains(options.field) ||
            !json[options.field].is_string()) {
          throw InputError(where() + " has no string field '" + options.field + "' (--field)");
        }
        const auto& text = json[options.field].get_ref<const std::string&>();
        if (!text.empty()) fn(text, at);
      }
    }
    at = stop + 1;
    release_behind(std::min(at, end));
  }
  if (paragraph_start != std::string_view::npos) {
    fn(std::string_view(base + paragraph_start, paragraph_end - paragraph_start), paragraph_start);
  }
  if (end > released) file.release(released, end - released);
}

}  // namespace mdist::cli
