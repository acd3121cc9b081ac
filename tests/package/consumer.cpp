// Uses the installed headers and library the way a user's program would.
#include <mdist/mdist.h>

#include <iostream>

int main() {
  const mdist::ParallelState state;
  std::cout << "consumer: size " << mdist::size() << ", " << state.data_parallel_group << std::endl;
  return mdist::size() == 1 && mdist::rank() == 0 ? 0 : 1;
}
