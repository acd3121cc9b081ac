#pragma once
// Exceptions thrown by mdist. Every message is one line that names what is wrong
// (which operation, group, rank, variable or value), so a user can act on it.
#include <stdexcept>
#include <string>

namespace mdist {

// Base of everything mdist throws on bad input or a failed operation.
class Error : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

// The launch environment (RANK, WORLD_SIZE, MASTER_PORT, ...) is missing or malformed.
class EnvironmentError : public Error {
 public:
  using Error::Error;
};

// A collective or the rendezvous failed: timeout, crashed peer, destroyed group.
class CommunicationError : public Error {
 public:
  using Error::Error;
};

// An object buffer is corrupt, truncated or holds another type than the one asked for.
class DecodeError : public Error {
 public:
  using Error::Error;
};

// A failure every rank of a job throws alike, with the same message, after agreeing on it
// (a checkpoint that could not be written, seen through an all-gather): a tool reports it once,
// from rank 0.
class AgreedError : public Error {
 public:
  using Error::Error;
};

// Bad input from a user: a flag, a file, a checkpoint or data that does not fit the model.
// mdist's tools report it as one line and exit code 2, before any output file is created.
class InputError : public Error {
 public:
  using Error::Error;
};

}  // namespace mdist
