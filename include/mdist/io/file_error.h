#pragma once
// The error of mdist's file helpers (mdist/io/atomic_file.h, mdist/io/mapped_file.h): a system
// call on a file failed. The message is one line naming the operation, the file and the system's
// reason; the parts are kept as well, so that a caller with its own wording (a safetensors
// reader, a command-line tool) can say the same thing its own way.
#include <filesystem>
#include <string>

#include "mdist/error.h"

namespace mdist::io {

class FileError : public Error {
 public:
  // what(): mdist: cannot OPERATION "PATH"[ to "TARGET"]: strerror(error_number), the paths
  // JSON-quoted so that the message stays one line whatever the names hold.
  FileError(std::string operation, std::filesystem::path path, int error_number,
            std::filesystem::path target = {});

  // What failed: "open", "stat", "mmap", "create temporary file", "write", "fsync", "close" or
  // "rename".
  const std::string& operation() const { return operation_; }
  const std::filesystem::path& path() const { return path_; }
  // The rename's destination (empty for the other operations).
  const std::filesystem::path& target() const { return target_; }
  // errno of the failed call.
  int error_number() const { return error_number_; }

 private:
  std::string operation_;
  std::filesystem::path path_;
  std::filesystem::path target_;
  int error_number_;
};

}  // namespace mdist::io
