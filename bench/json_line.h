#pragma once
// One JSON object on one line, built field by field: the benchmarks' output format, which the
// driver scripts parse to put C++ and Python figures side by side.
#include <cstdint>
#include <cstdio>
#include <sstream>
#include <string>
#include <vector>

namespace mdist::bench {

class JsonLine {
 public:
  JsonLine& add(const std::string& key, const std::string& value) {
    return raw(key, "\"" + value + "\"");  // callers pass plain text: no escaping needed
  }
  JsonLine& add(const std::string& key, const char* value) { return add(key, std::string(value)); }
  JsonLine& add(const std::string& key, int64_t value) { return raw(key, std::to_string(value)); }
  JsonLine& add(const std::string& key, int value) { return raw(key, std::to_string(value)); }
  JsonLine& add(const std::string& key, double value) { return raw(key, number(value)); }
  JsonLine& add(const std::string& key, const std::vector<double>& values) {
    std::string list = "[";
    for (std::size_t i = 0; i < values.size(); ++i) list += (i ? ", " : "") + number(values[i]);
    return raw(key, list + "]");
  }
  void print() const {
    std::printf("{%s}\n", fields_.c_str());
    std::fflush(stdout);
  }

 private:
  static std::string number(double value) {
    std::ostringstream out;
    out.precision(12);
    out << value;
    return out.str();
  }
  JsonLine& raw(const std::string& key, const std::string& value) {
    fields_ += (fields_.empty() ? "\"" : ", \"") + key + "\": " + value;
    return *this;
  }
  std::string fields_;
};

}  // namespace mdist::bench
