cmake_minimum_required(VERSION 3.25)
# Run at build time (POST_BUILD) on a Catch2 v2 test binary: registers one CTest test per test case
# and turns the tags [gpu], [multirank], [slow] and [faults] into CTest labels.
# Inputs: TEST_BIN, OUT_FILE, PREFIX, WORKDIR.
execute_process(COMMAND "${TEST_BIN}" --list-test-names-only OUTPUT_VARIABLE _all
                RESULT_VARIABLE _rc)
# Catch2 v2 returns the number of listed tests; anything but a number is a crash.
if(NOT _rc MATCHES "^[0-9]+$")
  message(FATAL_ERROR "listing tests of ${TEST_BIN} failed: ${_rc}")
endif()
string(REPLACE ";" "\\;" _all "${_all}")
string(REPLACE "\n" ";" _all "${_all}")
set(_labels gpu multirank slow faults)
foreach(_label IN LISTS _labels)
  execute_process(COMMAND "${TEST_BIN}" --list-test-names-only "[${_label}]"
                  OUTPUT_VARIABLE _tagged RESULT_VARIABLE _rc)
  string(REPLACE ";" "\\;" _tagged "${_tagged}")
  string(REPLACE "\n" ";" _tagged "${_tagged}")
  set(_with_${_label} "${_tagged}")
endforeach()
set(_out "")
foreach(_name IN LISTS _all)
  if(_name STREQUAL "")
    continue()
  endif()
  set(_lab "")
  foreach(_label IN LISTS _labels)
    list(FIND _with_${_label} "${_name}" _i)
    if(NOT _i EQUAL -1)
      list(APPEND _lab ${_label})
    endif()
  endforeach()
  if(NOT _lab)
    set(_lab unit)
  endif()
  string(REGEX REPLACE "([][,\\\\])" "\\\\\\1" _filter "${_name}")
  string(REPLACE ";" "\\;" _lab_s "${_lab}")
  string(APPEND _out
    "add_test([=[${PREFIX}${_name}]=] \"${TEST_BIN}\" [==[${_filter}]==])\n"
    "set_tests_properties([=[${PREFIX}${_name}]=] PROPERTIES WORKING_DIRECTORY \"${WORKDIR}\""
    " LABELS \"${_lab_s}\" SKIP_REGULAR_EXPRESSION \"troupe-skip:\")\n")
endforeach()
file(WRITE "${OUT_FILE}" "${_out}")
