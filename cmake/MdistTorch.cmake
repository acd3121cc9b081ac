# Imports libtorch's C++ libraries as targets without TorchConfig.cmake.
#
# Why not find_package(Torch): the libtorch of the `torch` wheel is a CUDA build, and its
# TorchConfig links every target against libtorch_cuda and the CUDA runtime. A CPU program
# then needs the whole CUDA stack at load time. mdist links libtorch_cpu alone unless
# MDIST_WITH_CUDA is on.
#
# Where libtorch is found, first match wins:
#   -DTorch_DIR=<root>/share/cmake/Torch   (the usual libtorch hint)
#   -DMDIST_LIBTORCH=<root> or the environment variable MDIST_LIBTORCH
#   the cache that scripts/install_libtorch.sh fills (~/.cache/mdist/libtorch-<version>)
set(MDIST_TORCH_VERSION 2.15.0)

# mdist's cache directory, the same rule as scripts/install_libtorch.sh: $MDIST_CACHE, else
# $XDG_CACHE_HOME/mdist, else ~/.cache/mdist (CMakeLists.txt puts the compiler cache there too).
function(mdist_cache_dir out)
  if(DEFINED ENV{MDIST_CACHE})
    set(${out} "$ENV{MDIST_CACHE}" PARENT_SCOPE)
  elseif(DEFINED ENV{XDG_CACHE_HOME})
    set(${out} "$ENV{XDG_CACHE_HOME}/mdist" PARENT_SCOPE)
  else()
    set(${out} "$ENV{HOME}/.cache/mdist" PARENT_SCOPE)
  endif()
endfunction()

if(NOT MDIST_LIBTORCH)
  if(Torch_DIR)
    get_filename_component(MDIST_LIBTORCH "${Torch_DIR}/../../.." ABSOLUTE)
  elseif(DEFINED ENV{MDIST_LIBTORCH})
    set(MDIST_LIBTORCH "$ENV{MDIST_LIBTORCH}")
  else()
    mdist_cache_dir(_mdist_cache)
    set(MDIST_LIBTORCH "${_mdist_cache}/libtorch-${MDIST_TORCH_VERSION}")
  endif()
endif()
set(MDIST_LIBTORCH "${MDIST_LIBTORCH}" CACHE PATH "libtorch root (include/, lib/)")

if(NOT EXISTS "${MDIST_LIBTORCH}/include/torch/csrc/api/include/torch/torch.h")
  message(FATAL_ERROR "mdist: no libtorch at '${MDIST_LIBTORCH}'. Run scripts/install_libtorch.sh, "
                      "or pass -DTorch_DIR=<libtorch>/share/cmake/Torch.")
endif()

find_path(MDIST_GLOO_INCLUDE_DIR gloo/rendezvous/store.h
          DOC "gloo headers (Debian: libgloo-dev); the wheel's libtorch ships none")
if(NOT MDIST_GLOO_INCLUDE_DIR)
  message(FATAL_ERROR "mdist: gloo headers not found; install libgloo-dev (scripts/setup.sh does).")
endif()

function(_mdist_import_torch_lib name)
  find_library(_lib_${name} NAMES ${name} PATHS "${MDIST_LIBTORCH}/lib" NO_DEFAULT_PATH REQUIRED)
  add_library(mdist_torch::${name} SHARED IMPORTED GLOBAL)
  set_target_properties(mdist_torch::${name} PROPERTIES IMPORTED_LOCATION "${_lib_${name}}")
endfunction()

_mdist_import_torch_lib(c10)
_mdist_import_torch_lib(torch_cpu)

# Imported, so that mdist's exported targets can name it and a consumer's find_package defines it.
add_library(mdist_torch::libtorch INTERFACE IMPORTED GLOBAL)
target_include_directories(mdist_torch::libtorch SYSTEM INTERFACE
  "${MDIST_LIBTORCH}/include" "${MDIST_LIBTORCH}/include/torch/csrc/api/include"
  "${MDIST_GLOO_INCLUDE_DIR}")
# The wheel's libtorch is built with these; its c10d headers hide Gloo without USE_C10D_GLOO.
target_compile_definitions(mdist_torch::libtorch INTERFACE USE_DISTRIBUTED USE_C10D_GLOO
                                                    _GLIBCXX_USE_CXX11_ABI=1)
target_link_libraries(mdist_torch::libtorch INTERFACE mdist_torch::torch_cpu mdist_torch::c10)

if(MDIST_WITH_CUDA)
  find_package(CUDAToolkit REQUIRED)
  _mdist_import_torch_lib(c10_cuda)
  _mdist_import_torch_lib(torch_cuda)
  target_compile_definitions(mdist_torch::libtorch INTERFACE USE_C10D_NCCL USE_CUDA MDIST_HAS_CUDA=1)
  target_link_libraries(mdist_torch::libtorch INTERFACE mdist_torch::torch_cuda mdist_torch::c10_cuda
                                                 CUDA::cudart)
  # libtorch_cuda needs cuSPARSELt, cuFile and NVSHMEM, which the toolkit may lack; they are
  # resolved when the program runs on a GPU machine with the full CUDA runtime.
  target_link_options(mdist_torch::libtorch INTERFACE "LINKER:--allow-shlib-undefined")
endif()
