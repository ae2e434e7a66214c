cmake_minimum_required(VERSION 3.25)
# Run at build time: writes a C++ source whose function FUNCTION (in namespace NAMESPACE) returns
# the text of IN as a std::string_view, so a static asset (the introspection dashboard) ships inside
# the binary without a build step of its own. Inputs: IN, OUT, NAMESPACE, FUNCTION, HEADER (the
# header declaring the function).
file(READ "${IN}" _text)
set(_delim "troupe_embed")
string(FIND "${_text}" ")${_delim}\"" _clash)
if(NOT _clash EQUAL -1)
  message(FATAL_ERROR "${IN} contains the raw string delimiter )${_delim}\"")
endif()
file(WRITE "${OUT}"
  "// Generated from ${IN} by cmake/EmbedText.cmake: do not edit.\n"
  "#include \"${HEADER}\"\n\n"
  "namespace ${NAMESPACE} {\n"
  "std::string_view ${FUNCTION}() {\n"
  "  return R\"${_delim}(${_text})${_delim}\";\n"
  "}\n"
  "}  // namespace ${NAMESPACE}\n")
