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

}  // namespace mdist
