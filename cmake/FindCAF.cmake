# Debian's libcaf-dev (0.17) ships neither a CMake config nor a pkg-config file.
find_path(CAF_INCLUDE_DIR NAMES caf/all.hpp)
find_library(CAF_CORE_LIBRARY NAMES caf_core)
find_library(CAF_IO_LIBRARY NAMES caf_io)
# Optional: CAF's openssl module (TLS for the control plane; `troupe launch --tls` needs it).
find_path(CAF_OPENSSL_INCLUDE_DIR NAMES caf/openssl/all.hpp)
find_library(CAF_OPENSSL_LIBRARY NAMES caf_openssl)
if(CAF_INCLUDE_DIR)
  file(STRINGS "${CAF_INCLUDE_DIR}/caf/config.hpp" _caf_v REGEX "^#define CAF_VERSION [0-9]+")
  string(REGEX REPLACE ".*CAF_VERSION ([0-9]+).*" "\\1" _caf_v "${_caf_v}")
  math(EXPR _caf_a "${_caf_v}/10000")
  math(EXPR _caf_b "(${_caf_v}/100)%100")
  math(EXPR _caf_c "${_caf_v}%100")
  set(CAF_VERSION "${_caf_a}.${_caf_b}.${_caf_c}")
endif()
include(FindPackageHandleStandardArgs)
find_package_handle_standard_args(CAF REQUIRED_VARS CAF_CORE_LIBRARY CAF_IO_LIBRARY CAF_INCLUDE_DIR
                                  VERSION_VAR CAF_VERSION)
if(CAF_FOUND AND NOT TARGET CAF::core)
  add_library(CAF::core UNKNOWN IMPORTED)
  set_target_properties(CAF::core PROPERTIES IMPORTED_LOCATION "${CAF_CORE_LIBRARY}"
    INTERFACE_INCLUDE_DIRECTORIES "${CAF_INCLUDE_DIR}" INTERFACE_LINK_LIBRARIES Threads::Threads)
  add_library(CAF::io UNKNOWN IMPORTED)
  set_target_properties(CAF::io PROPERTIES IMPORTED_LOCATION "${CAF_IO_LIBRARY}"
    INTERFACE_LINK_LIBRARIES CAF::core)
endif()
if(CAF_FOUND AND CAF_OPENSSL_LIBRARY AND CAF_OPENSSL_INCLUDE_DIR AND NOT TARGET CAF::openssl)
  add_library(CAF::openssl UNKNOWN IMPORTED)
  set_target_properties(CAF::openssl PROPERTIES IMPORTED_LOCATION "${CAF_OPENSSL_LIBRARY}"
    INTERFACE_INCLUDE_DIRECTORIES "${CAF_OPENSSL_INCLUDE_DIR}" INTERFACE_LINK_LIBRARIES CAF::io)
endif()
