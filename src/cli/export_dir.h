#pragma once
// The directory a quantized export is written to (`mdist quantize --out`, `mdist train
// --export-quantized`): checked before anything runs, staged beside it while it is written,
// then published by renames, so that a failure never leaves a half-written export behind.
//
// A new directory appears whole. An existing one keeps its other files and gets each of the
// export's files replaced whole (one rename per file); an index of sharded safetensors left in
// it would shadow the export's single file, so it goes.
#include <filesystem>
#include <string>
#include <vector>

namespace mdist::cli {

// InputError unless `out` can receive an export: an existing path must be a writable
// directory, a new one must be creatable (probed in its parent; nothing is created). `flag`
// names the option in the message ("--out", "--export-quantized").
void check_export_dir(const std::filesystem::path& out, const std::string& flag);

// The staging directory beside `out` (the same on every rank; a leftover of an interrupted run
// is recognised by its name and replaced).
std::filesystem::path staging_dir(const std::filesystem::path& out);

// Copies `files` into `dir` under their own names, each atomically (rank 0's job).
void copy_into(const std::vector<std::filesystem::path>& files, const std::filesystem::path& dir);

// Rank 0: the staged files into `out`, each by a rename (whole or not at all); `staging` is gone
// afterwards.
void publish(const std::filesystem::path& staging, const std::filesystem::path& out);

}  // namespace mdist::cli
