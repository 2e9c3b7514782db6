# Sourced by scripts/demo (and test scripts): find a Python >= 3.12 that runs.
#
# find_python echoes the interpreter's real path (sys.executable, not a pyenv
# shim), or prints why not on stderr and returns 1. $PYTHON, when set, is tried
# first. A name found on PATH is not enough: a pyenv shim such as python3.12
# exists everywhere but fails unless pyenv selects that version, so every
# candidate is run.

_python_is_usable() {
    "$1" -c 'import sys; sys.exit(0 if sys.version_info >= (3, 12) else 1)' >/dev/null 2>&1
}

find_python() {
    local candidate path root
    local -a candidates=()
    [[ -n "${PYTHON:-}" ]] && candidates+=("$PYTHON")
    candidates+=(python3.13 python3.12 python3)
    if command -v pyenv >/dev/null 2>&1 && root="$(pyenv root 2>/dev/null)" && [[ -n "$root" ]]; then
        candidates+=("$root"/versions/3.13*/bin/python "$root"/versions/3.12*/bin/python)
    fi
    candidates+=(/root/.pyenv/versions/3.13*/bin/python /root/.pyenv/versions/3.12*/bin/python)
    for candidate in "${candidates[@]}"; do
        # A glob that matched nothing stays as written and is not found here.
        path="$(command -v "$candidate" 2>/dev/null)" || continue
        if _python_is_usable "$path"; then
            "$path" -c 'import sys; print(sys.executable)'
            return 0
        fi
    done
    echo "No Python >= 3.12 found (tried: ${candidates[*]}). Install one, or set PYTHON=/path/to/python3.12." >&2
    return 1
}
