#include "mdist/objects/codec.h"

namespace mdist {

const char* tag_name(std::uint8_t tag) {
  switch (static_cast<Tag>(tag)) {
    case Tag::kBool:
      return "a bool";
    case Tag::kSigned:
      return "a signed integer";
    case Tag::kUnsigned:
      return "an unsigned integer";
    case Tag::kFloat:
      return "a floating-point number";
    case Tag::kString:
      return "a string";
    case Tag::kSequence:
      return "a sequence";
    case Tag::kPackedArray:
      return "an array of numbers";
    case Tag::kMap:
      return "a map";
    case Tag::kPair:
      return "a pair";
    case Tag::kTuple:
      return "a tuple";
    case Tag::kOptional:
      return "an optional";
    case Tag::kTensor:
      return "a tensor";
    case Tag::kSet:
      return "a set";
  }
  return "an unknown tag";
}

}  // namespace mdist
