# Sourced by the bench scripts. ensure_bench_venv MODULES: makes sure the bench-only venv at
# $venv imports MODULES (e.g. "torch, numpy"), creating or completing it from
# bench/requirements.txt first. Sets python_ok=0, and says so, when that fails: the Python rows
# then show the error instead of the whole benchmark stopping.
ensure_bench_venv() {
  python_ok=1
  if [[ ! -x "$venv/bin/python" ]] || ! "$venv/bin/python" -c "import $1" 2>/dev/null; then
    { python3 -m venv "$venv" && "$venv/bin/pip" install -q -r bench/requirements.txt; } ||
      { python_ok=0; echo "bench venv setup failed; Python rows will show the error" >&2; }
  fi
}
