// detect_launch_env: each launcher's variables, and every malformed value named in one line.
#include "mdist/runtime/environment.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <map>

#include "mdist/error.h"

namespace {

using ::testing::HasSubstr;
using Vars = std::map<std::string, std::string>;

mdist::EnvLookup table(const Vars& vars) {
  return [vars](const std::string& name) -> std::optional<std::string> {
    const auto it = vars.find(name);
    if (it == vars.end()) return std::nullopt;
    return it->second;
  };
}

std::string error_of(const Vars& vars, const std::optional<std::string>& addr = {}) {
  try {
    mdist::detect_launch_env(table(vars), addr);
  } catch (const mdist::EnvironmentError& error) {
    return error.what();
  }
  return "no error";
}

const Vars kTorchrun = {{"RANK", "3"},
                        {"WORLD_SIZE", "8"},
                        {"LOCAL_RANK", "1"},
                        {"LOCAL_WORLD_SIZE", "2"},
                        {"MASTER_ADDR", "node0"},
                        {"MASTER_PORT", "29501"}};

TEST(Environment, NoLauncherVariablesMeansAPlainProcess) {
  EXPECT_FALSE(mdist::detect_launch_env(table({})).has_value());
  EXPECT_FALSE(mdist::detect_launch_env(table({{"MASTER_ADDR", "x"}})).has_value());
}

TEST(Environment, Torchrun) {
  const auto env = mdist::detect_launch_env(table(kTorchrun));
  ASSERT_TRUE(env);
  EXPECT_EQ(env->source, mdist::LaunchSource::kTorchrun);
  EXPECT_EQ(env->rank, 3);
  EXPECT_EQ(env->world_size, 8);
  EXPECT_EQ(env->local_rank, 1);
  EXPECT_EQ(env->local_world_size, 2);
  EXPECT_EQ(env->master_addr, "node0");
  EXPECT_EQ(env->master_port, 29501);
  EXPECT_FALSE(env->store_listen_fd);
}

TEST(Environment, ListenFdFromTheLauncherIsRankZerosOnly) {
  Vars vars = kTorchrun;
  vars["MDIST_STORE_LISTEN_FD"] = "5";
  EXPECT_FALSE(mdist::detect_launch_env(table(vars))->store_listen_fd);
  vars["RANK"] = "0";
  EXPECT_EQ(mdist::detect_launch_env(table(vars))->store_listen_fd, 5);
}

TEST(Environment, OpenMPI) {
  const auto env = mdist::detect_launch_env(table({{"OMPI_COMM_WORLD_RANK", "5"},
                                                   {"OMPI_COMM_WORLD_SIZE", "6"},
                                                   {"OMPI_COMM_WORLD_LOCAL_RANK", "2"},
                                                   {"OMPI_COMM_WORLD_LOCAL_SIZE", "3"},
                                                   {"MASTER_ADDR", "10.1.2.3"}}));
  ASSERT_TRUE(env);
  EXPECT_EQ(env->source, mdist::LaunchSource::kOpenMPI);
  EXPECT_EQ(env->rank, 5);
  EXPECT_EQ(env->world_size, 6);
  EXPECT_EQ(env->local_rank, 2);
  EXPECT_EQ(env->local_world_size, 3);
  EXPECT_EQ(env->master_addr, "10.1.2.3");
  EXPECT_EQ(env->master_port, 29500);  // the default when MASTER_PORT is unset
}

TEST(Environment, PMI) {
  const auto env = mdist::detect_launch_env(table({{"PMI_RANK", "1"},
                                                   {"PMI_SIZE", "4"},
                                                   {"MPI_LOCALRANKID", "1"},
                                                   {"MPI_LOCALNRANKS", "2"},
                                                   {"MASTER_PORT", "4000"}}),
                                            std::string("head"));
  ASSERT_TRUE(env);
  EXPECT_EQ(env->source, mdist::LaunchSource::kPMI);
  EXPECT_EQ(env->rank, 1);
  EXPECT_EQ(env->world_size, 4);
  EXPECT_EQ(env->local_world_size, 2);
  EXPECT_EQ(env->master_addr, "head");  // explicit argument
  EXPECT_EQ(env->master_port, 4000);
}

TEST(Environment, SlurmTasksPerNode) {
  const Vars base = {{"SLURM_PROCID", "9"},
                     {"SLURM_NTASKS", "11"},
                     {"SLURM_LOCALID", "1"},
                     {"SLURM_NODEID", "2"},
                     {"SLURM_TASKS_PER_NODE", "4(x2),3"},
                     {"MASTER_ADDR", "n0"}};
  const auto env = mdist::detect_launch_env(table(base));
  ASSERT_TRUE(env);
  EXPECT_EQ(env->source, mdist::LaunchSource::kSlurm);
  EXPECT_EQ(env->rank, 9);
  EXPECT_EQ(env->world_size, 11);
  EXPECT_EQ(env->local_rank, 1);
  EXPECT_EQ(env->local_world_size, 3);
  Vars first = base;
  first["SLURM_NODEID"] = "1";
  EXPECT_EQ(mdist::detect_launch_env(table(first))->local_world_size, 4);
}

TEST(Environment, ExplicitMasterOverridesTheEnvironment) {
  const auto env = mdist::detect_launch_env(table(kTorchrun), std::string("10.0.0.9"), 1234);
  EXPECT_EQ(env->master_addr, "10.0.0.9");
  EXPECT_EQ(env->master_port, 1234);
}

TEST(Environment, BadValuesAreOneClearLine) {
  Vars vars = kTorchrun;
  vars["WORLD_SIZE"] = "abc";
  EXPECT_EQ(error_of(vars), "mdist: invalid WORLD_SIZE='abc': expected a positive integer");
  vars["WORLD_SIZE"] = "0";
  EXPECT_THAT(error_of(vars), HasSubstr("invalid WORLD_SIZE='0'"));
  vars["WORLD_SIZE"] = "8x";
  EXPECT_THAT(error_of(vars), HasSubstr("invalid WORLD_SIZE='8x'"));
  vars = kTorchrun;
  vars["RANK"] = "8";
  EXPECT_EQ(error_of(vars), "mdist: RANK=8 is out of range for WORLD_SIZE=8 (ranks are 0..7)");
  vars["RANK"] = "-1";
  EXPECT_EQ(error_of(vars), "mdist: invalid RANK='-1': expected a non-negative integer");
  vars = kTorchrun;
  vars["LOCAL_RANK"] = "2";
  EXPECT_EQ(error_of(vars), "mdist: LOCAL_RANK=2 is out of range for LOCAL_WORLD_SIZE=2");
  vars = kTorchrun;
  vars["MASTER_PORT"] = "70000";
  EXPECT_EQ(error_of(vars), "mdist: invalid MASTER_PORT='70000': expected a port in 1..65535");
  vars = kTorchrun;
  vars.erase("MASTER_ADDR");
  EXPECT_EQ(error_of(vars),
            "mdist: launched with torchrun-style variables but MASTER_ADDR is not set");
  vars = kTorchrun;
  vars.erase("WORLD_SIZE");
  EXPECT_EQ(error_of(vars),
            "mdist: launched with torchrun-style variables but WORLD_SIZE is not set");
}

TEST(Environment, MpiAndSlurmNeedAMasterAddress) {
  EXPECT_EQ(error_of({{"SLURM_PROCID", "0"}, {"SLURM_NTASKS", "2"}}),
            "mdist: launched by Slurm but no master address: set MASTER_ADDR or pass "
            "SetupOptions::master_addr");
  EXPECT_THAT(error_of({{"OMPI_COMM_WORLD_RANK", "0"}}),
              HasSubstr("launched by Open MPI but OMPI_COMM_WORLD_SIZE is not set"));
  EXPECT_THAT(error_of({{"SLURM_PROCID", "0"},
                        {"SLURM_NTASKS", "2"},
                        {"MASTER_ADDR", "a"},
                        {"SLURM_TASKS_PER_NODE", "2(x"}}),
              HasSubstr("invalid SLURM_TASKS_PER_NODE='2(x'"));
}

}  // namespace
