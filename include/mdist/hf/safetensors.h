#pragma once
// Hugging Face safetensors files and checkpoints: reading (memory-mapped, zero-copy where the
// data allows) and atomic writing.
//
// File format: an 8-byte little-endian u64 header length N, N bytes of UTF-8 JSON mapping each
// tensor name to {"dtype", "shape", "data_offsets": [begin, end]} (offsets relative to the byte
// buffer after the header) plus an optional "__metadata__" {string: string}, then the data.
// A sharded checkpoint is a directory with model.safetensors.index.json
// ({"metadata": {"total_size": N}, "weight_map": {tensor name: shard file name}}) and shards.
//
// Every malformed file raises SafetensorsError with a one-line message naming the file and the
// problem; nothing malformed is read out of bounds.
//
//   mdist::hf::SafetensorsCheckpoint ckpt("/models/llama");
//   at::Tensor w = ckpt.read_rows("model.embed_tokens.weight", rank * rows, rows);
//
// Supported dtypes: F64 F32 F16 BF16 I64 I32 I16 I8 U8 BOOL U16 U32 U64 F8_E4M3 F8_E5M2.
#include <ATen/core/Tensor.h>
#include <c10/core/ScalarType.h>

#include <cstdint>
#include <filesystem>
#include <map>
#include <memory>
#include <string>
#include <string_view>
#include <vector>

#include "mdist/error.h"

namespace mdist::io {
class MappedFile;
}  // namespace mdist::io

namespace mdist::hf {

// A safetensors file or checkpoint is malformed, missing, or cannot be written.
class SafetensorsError : public Error {
 public:
  using Error::Error;
};

struct TensorInfo {
  c10::ScalarType dtype;
  std::vector<std::int64_t> shape;
  // Byte range [begin, end) relative to the data buffer that follows the header.
  std::uint64_t begin = 0;
  std::uint64_t end = 0;
};

// One .safetensors file, memory-mapped read-only for the object's lifetime (and for as long as
// any zero-copy tensor from it lives). The header is parsed and fully validated at open.
// The file must not be truncated or rewritten in place while mapped (that raises SIGBUS, as
// for any mmap); the writers below replace files by rename, which is safe.
class SafetensorsFile {
 public:
  explicit SafetensorsFile(const std::filesystem::path& path);

  const std::filesystem::path& path() const { return path_; }
  // Tensor names, sorted.
  std::vector<std::string> names() const;
  bool contains(const std::string& name) const { return tensors_.count(name) != 0; }
  // Throws SafetensorsError for an unknown name.
  const TensorInfo& info(const std::string& name) const;
  // The "__metadata__" entries (empty when the file has none).
  const std::map<std::string, std::string>& metadata() const { return metadata_; }

  // The whole tensor, on CPU. When its data is aligned to the element size (always the case for
  // files written by mdist and by the official safetensors library) the tensor ALIASES THE
  // READ-ONLY MAPPING: no copy is made, and writing to it crashes the process (SIGSEGV). Call
  // .clone() before modifying it. Unaligned data is copied into a fresh, writable tensor.
  at::Tensor tensor(const std::string& name) const;
  // Rows [first_row, first_row + rows) along dim 0, copied into a fresh, writable, contiguous
  // tensor; only those bytes are read. Needs a tensor with at least one dimension.
  at::Tensor read_rows(const std::string& name, std::int64_t first_row, std::int64_t rows) const;

  // Drops this process's resident pages of `name`'s data (madvise MADV_DONTNEED on the pages
  // its bytes touch): they stop counting in this process's RSS but stay in the page cache, and
  // are read again from the file when touched (zero-copy tensors stay valid). For a loader
  // that reads each tensor once, so that the mapped file never adds up in memory.
  void release_pages(const std::string& name) const;
  // Where the mapping of this file starts and how long it is (for tests and diagnostics).
  const void* mapping_data() const;
  std::size_t mapping_size() const;

 private:
  [[noreturn]] void fail(const std::string& problem) const;
  const std::uint8_t* data_of(const TensorInfo& info) const;

  std::filesystem::path path_;
  std::shared_ptr<const io::MappedFile> mapping_;
  std::uint64_t data_start_ = 0;  // file offset of the data buffer
  std::map<std::string, TensorInfo> tensors_;
  std::map<std::string, std::string> metadata_;
};

// A checkpoint directory: model.safetensors, or model.safetensors.index.json and its shards
// (model.safetensors wins when both exist, as in transformers). All files are opened and
// validated at construction; every name in the index must exist in its shard.
class SafetensorsCheckpoint {
 public:
  explicit SafetensorsCheckpoint(const std::filesystem::path& dir);

  const std::filesystem::path& dir() const { return dir_; }
  // Tensor names, sorted.
  std::vector<std::string> names() const;
  bool contains(const std::string& name) const { return owner_.count(name) != 0; }
  const TensorInfo& info(const std::string& name) const;
  // As SafetensorsFile::tensor (zero-copy tensors alias a read-only mapping).
  at::Tensor tensor(const std::string& name) const;
  at::Tensor read_rows(const std::string& name, std::int64_t first_row, std::int64_t rows) const;
  void release_pages(const std::string& name) const { file_of(name).release_pages(name); }
  // The file holding `name`.
  const SafetensorsFile& file_of(const std::string& name) const;
  std::size_t num_files() const { return files_.size(); }

 private:
  std::filesystem::path dir_;
  std::vector<std::unique_ptr<SafetensorsFile>> files_;
  std::map<std::string, std::size_t> owner_;  // name -> index into files_
};

// Writes one safetensors file atomically (mdist/io/atomic_file.h): a temporary file in the same
// directory is written, fsynced and renamed over `path`, so `path` never holds a partial file.
// Tensors are written contiguous, from CPU, in descending order of element size then by name,
// packed without gaps (as the official library requires), with the data buffer starting 8-byte
// aligned (header padded with spaces); so every tensor is aligned to its element size.
void save_safetensors(const std::filesystem::path& path,
                      const std::map<std::string, at::Tensor>& tensors,
                      const std::map<std::string, std::string>& metadata = {});

// Writes a checkpoint directory (created if missing): model.safetensors when the tensors'
// total byte size is at most max_shard_bytes, else model-0000i-of-0000N.safetensors shards
// (filled greedily in name order; a tensor larger than the limit gets a shard of its own) and
// model.safetensors.index.json with metadata.total_size. Every file carries the metadata
// {"format": "pt"}. All files are written under temporary names first and renamed at the end,
// index last; the stale model.safetensors or index of the other layout is then removed.
void save_checkpoint(const std::filesystem::path& dir,
                     const std::map<std::string, at::Tensor>& tensors,
                     std::uint64_t max_shard_bytes);

// Writes `contents` to `path` through a fsynced temporary file and a rename: `path` holds the
// old file or the whole new one, never a part. mdist::io::write_file_atomically (the same, in
// mdist/io/atomic_file.h) with its failures thrown as SafetensorsError, for the callers that
// catch that.
void write_file_atomically(const std::filesystem::path& path, std::string_view contents);

// The safetensors name of a dtype ("F32", ...) and back; throw SafetensorsError if unsupported.
std::string dtype_name(c10::ScalarType dtype);
c10::ScalarType dtype_from_name(const std::string& name);

}  // namespace mdist::hf
