// Unit tests of the file helpers: mdist::io::AtomicFile / write_file_atomically and
// mdist::io::MappedFile.
#include <gmock/gmock.h>
#include <gtest/gtest.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <filesystem>
#include <fstream>
#include <sstream>
#include <string>
#include <utility>
#include <vector>

#include "mdist/io/atomic_file.h"
#include "mdist/io/mapped_file.h"

namespace fs = std::filesystem;
using ::testing::HasSubstr;

namespace {

class FileIo : public ::testing::Test {
 protected:
  void SetUp() override {
    dir_ = fs::temp_directory_path() /
           ("mdist_file_io_test_" + std::to_string(::getpid()) + "_" +
            ::testing::UnitTest::GetInstance()->current_test_info()->name());
    fs::remove_all(dir_);
    fs::create_directories(dir_);
  }
  void TearDown() override { fs::remove_all(dir_); }

  static std::string read(const fs::path& path) {
    std::ifstream in(path, std::ios::binary);
    std::stringstream text;
    text << in.rdbuf();
    return text.str();
  }
  // The names in the test directory, sorted.
  std::vector<std::string> names() const {
    std::vector<std::string> found;
    for (const auto& entry : fs::directory_iterator(dir_)) {
      found.push_back(entry.path().filename().string());
    }
    std::sort(found.begin(), found.end());
    return found;
  }

  fs::path dir_;
};

TEST_F(FileIo, WriteFileAtomicallyReplacesTheFileAndLeavesNoTemporary) {
  const fs::path path = dir_ / "config.json";
  mdist::io::write_file_atomically(path, "old");
  mdist::io::write_file_atomically(path, std::string("new\0contents", 12));
  EXPECT_EQ(read(path), std::string("new\0contents", 12));
  EXPECT_EQ(names(), std::vector<std::string>{"config.json"});
}

TEST_F(FileIo, StreamedWritesBecomeVisibleOnlyOnCommit) {
  const fs::path path = dir_ / "out.bin";
  mdist::io::write_file_atomically(path, "old");
  mdist::io::AtomicFile file(path);
  EXPECT_EQ(file.temp_path().parent_path(), dir_);
  EXPECT_THAT(file.temp_path().filename().string(), HasSubstr(".out.bin.tmp."));
  file.write("first ");
  file.write("second");
  EXPECT_EQ(read(path), "old");
  file.commit();
  EXPECT_EQ(read(path), "first second");
  EXPECT_EQ(names(), std::vector<std::string>{"out.bin"});
}

TEST_F(FileIo, AnUncommittedFileIsRemovedAndTheOldOneKept) {
  const fs::path path = dir_ / "out.bin";
  mdist::io::write_file_atomically(path, "old");
  try {
    mdist::io::AtomicFile file(path);
    file.write("partial");
    throw std::runtime_error("the writer fails half way");
  } catch (const std::runtime_error&) {
  }
  EXPECT_EQ(read(path), "old");
  EXPECT_EQ(names(), std::vector<std::string>{"out.bin"});
}

TEST_F(FileIo, FailuresNameTheOperationTheFileAndTheReason) {
  try {
    mdist::io::write_file_atomically(dir_ / "missing" / "x.json", "{}");
    ADD_FAILURE() << "wrote into a missing directory";
  } catch (const mdist::io::FileError& e) {
    EXPECT_EQ(e.operation(), "create temporary file");
    EXPECT_EQ(e.error_number(), ENOENT);
    EXPECT_THAT(e.what(), HasSubstr("mdist: cannot create temporary file \"" +
                                    (dir_ / "missing" / ".x.json.tmp.").string()));
    EXPECT_THAT(e.what(), HasSubstr(": No such file or directory"));
  }
  // The rename fails (the target is a non-empty directory): the temporary file goes.
  fs::create_directories(dir_ / "blocked" / "inside");
  try {
    mdist::io::write_file_atomically(dir_ / "blocked", "x");
    ADD_FAILURE() << "renamed over a non-empty directory";
  } catch (const mdist::io::FileError& e) {
    EXPECT_EQ(e.operation(), "rename");
    EXPECT_EQ(e.target(), dir_ / "blocked");
    EXPECT_THAT(e.what(), HasSubstr("mdist: cannot rename \""));
    EXPECT_THAT(e.what(), HasSubstr("\" to \"" + (dir_ / "blocked").string() + "\": "));
  }
  EXPECT_EQ(names(), std::vector<std::string>{"blocked"});
}

TEST_F(FileIo, MappedFileHoldsTheBytesAndSurvivesReleasingPages) {
  std::string bytes(3 * 4096 + 17, '\0');
  for (std::size_t i = 0; i < bytes.size(); ++i) bytes[i] = static_cast<char>(i * 7);
  mdist::io::write_file_atomically(dir_ / "data.bin", bytes);
  const mdist::io::MappedFile file(dir_ / "data.bin");
  ASSERT_EQ(file.size(), bytes.size());
  EXPECT_EQ(file.path(), dir_ / "data.bin");
  EXPECT_EQ(std::string(reinterpret_cast<const char*>(file.data()), file.size()), bytes);
  file.release(100, 5000);
  file.release(0, file.size() * 2);   // clipped to the file
  file.release(file.size() + 1, 10);  // nothing
  EXPECT_EQ(std::string(reinterpret_cast<const char*>(file.data()), file.size()), bytes);
}

TEST_F(FileIo, MappedFileOfAnEmptyOrMissingFile) {
  mdist::io::write_file_atomically(dir_ / "empty", "");
  const mdist::io::MappedFile empty(dir_ / "empty");
  EXPECT_EQ(empty.size(), 0u);
  EXPECT_EQ(empty.data(), nullptr);
  empty.release(0, 10);
  try {
    const mdist::io::MappedFile missing(dir_ / "missing");
    ADD_FAILURE() << "mapped a missing file";
  } catch (const mdist::io::FileError& e) {
    EXPECT_EQ(e.operation(), "open");
    EXPECT_EQ(e.error_number(), ENOENT);
    EXPECT_EQ(std::string(e.what()), "mdist: cannot open \"" + (dir_ / "missing").string() +
                                         "\": No such file or directory");
  }
}

TEST_F(FileIo, MovingAMappedFileHandsTheMappingOver) {
  mdist::io::write_file_atomically(dir_ / "data.bin", "abc");
  mdist::io::MappedFile first(dir_ / "data.bin");
  const unsigned char* data = first.data();
  mdist::io::MappedFile second(std::move(first));
  EXPECT_EQ(second.data(), data);
  EXPECT_EQ(second.size(), 3u);
  EXPECT_EQ(first.data(), nullptr);  // NOLINT(bugprone-use-after-move): moved-from is empty
  EXPECT_EQ(first.size(), 0u);
  first = std::move(second);
  EXPECT_EQ(first.data(), data);
  EXPECT_EQ(std::string(reinterpret_cast<const char*>(first.data()), first.size()), "abc");
}

}  // namespace
