#pragma once
// The documents of a text corpus, as `mdist tokenize` and tokenized --data read them: a text
// file cut into lines (the default), paragraphs (runs of non-empty lines, separated by empty
// lines) or one document, or a JSON Lines file with one document per line in a string field.
// Empty documents are skipped. A range of the file is read from its memory mapping, pages
// handed back as it is passed, so that reading a corpus of any size takes bounded memory.
//
// Ranks split a corpus by byte ranges whose ends are moved to the next document boundary
// (next_boundary), so that every document lies in exactly one range whatever their number.
#include <cstddef>
#include <cstdint>
#include <filesystem>
#include <functional>
#include <string>
#include <string_view>

#include "mdist/io/mapped_file.h"

namespace mdist::cli {

// A data file of the command, memory-mapped (mdist::io::MappedFile), with the command's checks
// and messages: InputError naming the file as `what` ("data file"): "data file 'PATH' does not
// exist", "... is a directory", "cannot read data file 'PATH': REASON", "cannot map ...".
class MappedFile : public io::MappedFile {
 public:
  MappedFile(const std::filesystem::path& path, const char* what);
};

enum class DocumentFormat { text, jsonl };
enum class SampleBy { line, paragraph, document };

struct DocumentOptions {
  DocumentFormat format = DocumentFormat::text;
  std::string field = "text";  // jsonl: the field holding the document's text
  SampleBy sample_by = SampleBy::line;
};

DocumentFormat parse_document_format(const std::string& name);  // throws InputError
SampleBy parse_sample_by(const std::string& name);              // throws InputError

// The first document boundary at or after `offset` (0 and the file's size are boundaries;
// lines: just after a '\n'; paragraphs: just after an empty line, "\n\n"; one document: none
// in between).
std::size_t next_boundary(const io::MappedFile& file, std::size_t offset, SampleBy sample_by);

// Part `index` of `count` of the file, cut at document boundaries: the parts cover the file,
// do not overlap, and do not depend on anything but the file, the options and `count`.
std::pair<std::size_t, std::size_t> document_range(const io::MappedFile& file, int index, int count,
                                                   SampleBy sample_by);

// Calls fn(document text, byte offset of the document) for every non-empty document that
// starts in [begin, end), in order; begin and end must be boundaries. A JSON Lines line that
// is not an object with a string field `field` is an InputError naming the file, the line
// number and the field. Lines lose a trailing '\r'.
void for_each_document(const io::MappedFile& file, std::size_t begin, std::size_t end,
                       const DocumentOptions& options,
                       const std::function<void(std::string_view, std::size_t)>& fn);

}  // namespace mdist::cli
