# NVSHMEM: the internode mode's network rings, and the low-latency region in NVSHMEM symmetric memory with puts
# for peers that a peer pointer cannot reach (docs/design.md, "Low-latency transports"). Without it the internode
# mode reports EPX_ERR_NOT_SUPPORTED and the low-latency mode works inside one NVLink domain through the CUDA IPC
# buffer.
#
#   -DEPX_NVSHMEM=AUTO (default): use NVSHMEM when EPX_NVSHMEM_DIR or python3's site-packages has it
#   -DEPX_NVSHMEM=ON: require it;  -DEPX_NVSHMEM=OFF: never use it
#   -DEPX_NVSHMEM_DIR=<root with include/ and lib/>, e.g. .../site-packages/nvidia/nvshmem (the pip package
#    nvidia-nvshmem-cu13)
# Sets EPX_HAVE_NVSHMEM and the imported targets epx::nvshmem_host and epx::nvshmem_device.
set(EPX_NVSHMEM AUTO CACHE STRING "Build with NVSHMEM (internode mode, low-latency NVSHMEM transport): AUTO, ON or OFF")
set_property(CACHE EPX_NVSHMEM PROPERTY STRINGS AUTO ON OFF)
set(EPX_NVSHMEM_DIR "" CACHE PATH "NVSHMEM root (include/, lib/): e.g. site-packages/nvidia/nvshmem")
# Where the GPU machines keep NVSHMEM: binaries are built on CPU machines and carried there, so libepx.so
# looks for libnvshmem_host.so.3 at the build-time location first, then here.
set(EPX_NVSHMEM_RUNTIME_DIRS "/opt/torch/.venv/lib/python3.12/site-packages/nvidia/nvshmem/lib"
    CACHE STRING "Extra run-time search paths (rpath) for libnvshmem_host.so.3, separated by ;")

set(EPX_HAVE_NVSHMEM OFF)
string(TOUPPER "${EPX_NVSHMEM}" _epx_nvshmem_mode)
if(NOT _epx_nvshmem_mode MATCHES "^(AUTO|ON|OFF)$")
  message(FATAL_ERROR "EPX_NVSHMEM must be AUTO, ON or OFF, got '${EPX_NVSHMEM}'")
endif()

function(_epx_nvshmem_usable dir out)
  if(dir AND EXISTS "${dir}/include/nvshmem.h" AND EXISTS "${dir}/lib/libnvshmem_device.a" AND
     (EXISTS "${dir}/lib/libnvshmem_host.so.3" OR EXISTS "${dir}/lib/libnvshmem_host.so"))
    set(${out} ON PARENT_SCOPE)
  else()
    set(${out} OFF PARENT_SCOPE)
  endif()
endfunction()

if(NOT _epx_nvshmem_mode STREQUAL "OFF")
  set(_dir "${EPX_NVSHMEM_DIR}")
  if(NOT _dir)
    # The pip package is a namespace package (no __init__.py): ask for its search location.
    find_program(_epx_python3 NAMES python3)
    if(_epx_python3)
      string(CONCAT _probe "import importlib.util as u\ns = u.find_spec('nvidia.nvshmem')\n"
                           "print(list(s.submodule_search_locations)[0] if s and s.submodule_search_locations else '')")
      execute_process(COMMAND "${_epx_python3}" -c "${_probe}" OUTPUT_VARIABLE _dir OUTPUT_STRIP_TRAILING_WHITESPACE
                      ERROR_QUIET RESULT_VARIABLE _rc)
      if(NOT _rc EQUAL 0)
        set(_dir "")
      endif()
    endif()
  endif()
  _epx_nvshmem_usable("${_dir}" _ok)
  if(_ok)
    set(EPX_HAVE_NVSHMEM ON)
    set(EPX_NVSHMEM_ROOT "${_dir}")
  elseif(_epx_nvshmem_mode STREQUAL "ON")
    message(FATAL_ERROR "EPX_NVSHMEM=ON but no NVSHMEM found (looked at EPX_NVSHMEM_DIR='${EPX_NVSHMEM_DIR}' and "
                        "python3's nvidia.nvshmem: '${_dir}'). Install it, e.g. python3 -m pip install --target DIR "
                        "nvidia-nvshmem-cu13==3.4.5, and pass -DEPX_NVSHMEM_DIR=DIR/nvidia/nvshmem")
  endif()
endif()

if(EPX_HAVE_NVSHMEM)
  if(EXISTS "${EPX_NVSHMEM_ROOT}/lib/libnvshmem_host.so.3")
    set(_host "${EPX_NVSHMEM_ROOT}/lib/libnvshmem_host.so.3")  # the pip package has no unversioned name
  else()
    set(_host "${EPX_NVSHMEM_ROOT}/lib/libnvshmem_host.so")
  endif()
  add_library(epx::nvshmem_host SHARED IMPORTED)
  set_target_properties(epx::nvshmem_host PROPERTIES IMPORTED_LOCATION "${_host}" IMPORTED_NO_SONAME OFF)
  # Host code that includes nvshmem.h with g++ needs CUDA 13's CCCL headers (cuda/std/...).
  set(_cccl "")
  foreach(_inc IN LISTS CUDAToolkit_INCLUDE_DIRS)
    if(EXISTS "${_inc}/cccl")
      list(APPEND _cccl "${_inc}/cccl")
    endif()
  endforeach()
  target_include_directories(epx::nvshmem_host INTERFACE "${EPX_NVSHMEM_ROOT}/include" ${_cccl})
  add_library(epx::nvshmem_device STATIC IMPORTED)
  set_target_properties(epx::nvshmem_device PROPERTIES IMPORTED_LOCATION "${EPX_NVSHMEM_ROOT}/lib/libnvshmem_device.a")
  target_include_directories(epx::nvshmem_device INTERFACE "${EPX_NVSHMEM_ROOT}/include")
  message(STATUS "NVSHMEM: ${EPX_NVSHMEM_ROOT} (low-latency mode: NVSHMEM symmetric memory; CUDA IPC with "
                 "EPX_DISABLE_NVSHMEM=1)")
else()
  message(STATUS "NVSHMEM: not used (EPX_NVSHMEM=${EPX_NVSHMEM}); the low-latency mode uses the CUDA IPC buffer")
endif()
