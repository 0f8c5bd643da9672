#!/usr/bin/env bash
# Build what the tests need (once) and run them: bash scripts/test.sh [pytest args]
#
# With no arguments, the whole suite, as several pytest processes: in one long process the
# fresh-clone CI hit XLA CPU segfaults inside compiles of unrelated tests (3 runs, at different
# tests; never reproduced in a short process). The groups are derived from the tree, so a new test
# file or directory runs without touching this script:
#   - every directory under tests/ that holds test files, one process each (less what runs alone),
#     but those of $alone_dirs, whose every file runs in a process of its own (tests/models: the
#     most compiles per file; its one process segfaulted in XLA's CPU compiler once it grew);
#   - every test file directly under tests/, one process each;
#   - every test file that runs a Mosaic GPU kernel in GPU interpret mode (`interpret=True`), alone;
#   - each interpret-mode case of the runner (tests/engine/test_runner.py, ids `kernel-*`), alone.
# Before running, every test file must belong to a group (else exit 3). A header precedes each
# group; a summary (per group: pass/fail and time; the total) ends the run. Exit status: 0 when
# every group passed, else the first failing group's pytest status (5: it collected no test).
# JAXSERVE_TEST_COLLECT=1 runs each group as `pytest --collect-only -q` (checks the grouping fast).
#
# With arguments, one pytest run with those arguments.
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/env.sh"
ensure_engine_env
ensure_torch_env
cd "$JAXSERVE_ROOT"
export JAXSERVE_TORCH_PYTHON="$JAXSERVE_ROOT/.venv-torch/bin/python"
py="$JAXSERVE_ROOT/.venv/bin/python"
if [ $# -gt 0 ]; then
  exec "$py" -m pytest "$@"
fi
pytest_cmd=("$py" -m pytest -p no:cacheprovider)
if [ "${JAXSERVE_TEST_COLLECT:-0}" = 1 ]; then pytest_cmd+=(--collect-only -q); fi

mapfile -t test_files < <(find tests -type f \( -name 'test_*.py' -o -name '*_test.py' \) | sort)
mapfile -t interpreted < <(grep -l 'interpret=True' "${test_files[@]}" || true)
interpreted+=(tests/parallel/test_replicas.py)  # alone too: three servers and two routers as subprocesses
# alone too: its stacked 24-layer programs are tests/engine's largest compiles (the long process
# once ran out of memory mappings there; tests/conftest.py drops compiled programs between modules)
interpreted+=(tests/engine/test_step_memory.py)
runner=tests/engine/test_runner.py
mapfile -t runner_cases < <("$py" -m pytest -p no:cacheprovider --collect-only "$runner" -k kernel- 2>/dev/null \
                             | grep -o '\[kernel-[^]]*\]' | tr -d '[]' | sort -u || true)
if [ ${#runner_cases[@]} -eq 0 ]; then echo "test.sh: found no kernel-* case in $runner" >&2; exit 3; fi

# A group: its label and its pytest arguments (joined by the unit separator $US).
US=$'\x1f' labels=() groups=()
add_group() { labels+=("$1"); shift; local IFS=$US; groups+=("$*"); }
ignore=("${interpreted[@]/#/--ignore=}")
alone_dirs=(tests/models)
for d in $(printf '%s\n' "${test_files[@]}" | awk -F/ 'NF > 2 {print $1 "/" $2}' | sort -u); do
  if [[ " ${alone_dirs[*]} " == *" $d "* ]]; then
    for f in "${test_files[@]}"; do
      if [ "$(dirname "$f")" = "$d" ] && [[ " ${interpreted[*]} " != *" $f "* ]]; then add_group "$f" "$f"; fi
    done
  elif [[ $runner == "$d"/* ]]; then
    add_group "$d (but $(basename "$runner")'s kernel-* cases)" "$d" "${ignore[@]}" -k "not (test_runner.py and kernel-)"
  else
    add_group "$d" "$d" "${ignore[@]}"
  fi
done
for f in "${test_files[@]}"; do
  if [ "$(dirname "$f")" = tests ]; then add_group "$f" "$f"; fi
done
for f in "${interpreted[@]}"; do add_group "$f" "$f"; done
for c in "${runner_cases[@]}"; do add_group "$runner -k $c" "$runner" -k "$c"; done

# Every test file belongs to a group: an interpreted file by name, any other by its directory.
for f in "${test_files[@]}"; do
  covered=0
  for g in "${groups[@]}"; do
    first=${g%%"$US"*}
    if [ "$first" = "$f" ] || { [ -d "$first" ] && [[ $f == "$first"/* ]]; }; then covered=1; break; fi
  done
  if [ $covered = 0 ]; then echo "test.sh: $f belongs to no group" >&2; exit 3; fi
done

rc=0 summary=() start=$SECONDS n=${#groups[@]}
for i in "${!groups[@]}"; do
  IFS=$US read -r -a args <<< "${groups[$i]}"
  printf '\n===== [%d/%d] %s =====\n' $((i + 1)) "$n" "${labels[$i]}"
  t0=$SECONDS g_rc=0
  "${pytest_cmd[@]}" "${args[@]}" || g_rc=$?
  case $g_rc in 0) status=pass ;; 5) status="FAIL (no tests)" ;; *) status="FAIL (exit $g_rc)" ;; esac
  summary+=("$(printf '  %-17s %5ds  %s' "$status" $((SECONDS - t0)) "${labels[$i]}")")
  if [ $g_rc -ne 0 ] && [ $rc -eq 0 ]; then rc=$g_rc; fi
done
elapsed=$((SECONDS - start))
printf '\n===== summary =====\n'
printf '%s\n' "${summary[@]}"
failed=$(printf '%s\n' "${summary[@]}" | grep -c '^  FAIL' || true)
printf '  %d groups, %d failed, total %dm%02ds\n' "$n" "$failed" $((elapsed / 60)) $((elapsed % 60))
exit $rc
