// See src/cli/export_dir.h.
#include "src/cli/export_dir.h"

#include <fstream>
#include <sstream>

#include "mdist/error.h"
#include "mdist/io/atomic_file.h"
#include "src/cli/input_error.h"
#include "src/cli/session.h"

namespace mdist::cli {

void check_export_dir(const std::filesystem::path& out, const std::string& flag) {
  std::error_code ec;
  if (std::filesystem::exists(out, ec)) {
    if (!std::filesystem::is_directory(out, ec)) {
      throw InputError(flag + " '" + out.string() + "' exists and is not a directory");
    }
    check_writable_dir(out, (flag + " directory").c_str());
  } else {
    check_writable_file(out, (flag + " directory").c_str());
  }
}

std::filesystem::path staging_dir(const std::filesystem::path& out) {
  const std::filesystem::path absolute = std::filesystem::absolute(out).lexically_normal();
  const std::filesystem::path parent =
      absolute.has_filename() ? absolute.parent_path() : absolute.parent_path().parent_path();
  const std::string name =
      (absolute.has_filename() ? absolute.filename() : absolute.parent_path().filename()).string();
  return parent / ("." + name + ".mdist-quantize-partial");
}

void copy_into(const std::vector<std::filesystem::path>& files, const std::filesystem::path& dir) {
  for (const auto& file : files) {
    std::ifstream in(file, std::ios::binary);
    std::ostringstream text;
    text << in.rdbuf();
    if (!in) throw Error("cannot read " + file.string());
    io::write_file_atomically(dir / file.filename(), text.str());
  }
}

void publish(const std::filesystem::path& staging, const std::filesystem::path& out) {
  if (!std::filesystem::exists(out)) {
    std::filesystem::rename(staging, out);
    io::sync_directory(std::filesystem::absolute(out).parent_path());
    return;
  }
  if (!std::filesystem::exists(staging / "model.safetensors.index.json")) {
    std::filesystem::remove(out / "model.safetensors.index.json");
  }
  for (const auto& entry : std::filesystem::directory_iterator(staging)) {
    std::filesystem::rename(entry.path(), out / entry.path().filename());
  }
  std::filesystem::remove_all(staging);
  io::sync_directory(out);
}

}  // namespace mdist::cli
