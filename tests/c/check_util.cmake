# Helpers of the check_*.cmake scripts (run with cmake -P).

# check_require(script VAR...): fails unless every VAR was given with -D.
function(check_require script)
  foreach(v IN LISTS ARGN)
    if(NOT DEFINED ${v})
      message(FATAL_ERROR "${script}: -D${v}= missing")
    endif()
  endforeach()
endfunction()

# run(COMMAND...): runs it, fails with its output unless it exits 0; its
# output is left in run_out.
function(run)
  execute_process(COMMAND ${ARGN} RESULT_VARIABLE rc OUTPUT_VARIABLE out ERROR_VARIABLE out)
  if(NOT rc EQUAL 0)
    list(JOIN ARGN " " cmd)
    message(FATAL_ERROR "${cmd}: exit ${rc}\n${out}")
  endif()
  set(run_out "${out}" PARENT_SCOPE)
endfunction()
