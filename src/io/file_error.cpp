// See mdist/io/file_error.h.
#include "mdist/io/file_error.h"

#include <cstring>
#include <nlohmann/json.hpp>
#include <utility>

namespace mdist::io {
namespace {

// A JSON-quoted string, control characters escaped and bad UTF-8 replaced: one line, always.
std::string quote(const std::string& text) {
  return nlohmann::json(text).dump(-1, ' ', false, nlohmann::json::error_handler_t::replace);
}

std::string message_of(const std::string& operation, const std::filesystem::path& path,
                       int error_number, const std::filesystem::path& target) {
  return "mdist: cannot " + operation + " " + quote(path.string()) +
         (target.empty() ? "" : " to " + quote(target.string())) + ": " +
         std::strerror(error_number);
}

}  // namespace

FileError::FileError(std::string operation, std::filesystem::path path, int error_number,
                     std::filesystem::path target)
    : Error(message_of(operation, path, error_number, target)),
      operation_(std::move(operation)),
      path_(std::move(path)),
      target_(std::move(target)),
      error_number_(error_number) {}

}  // namespace mdist::io
