#!/bin/sh
# The router image's Python environment, built the same way in two places: deploy/Containerfile
# RUNs this script, and tests/deploy/test_image_env.py runs it with the same arguments (paths
# moved into a temporary folder), so the image definition cannot rot unnoticed.
#
#   build-env.sh wheel SRC DIST     the firstbyte wheel from the source tree SRC, into DIST
#                                   (no dependencies: they come from the index in `venv`)
#   build-env.sh venv DIST PREFIX   a virtual environment at PREFIX holding firstbyte[router]
#                                   from DIST's wheel, and nothing else
#
# PYTHON names the interpreter (default python3: the base image's).
set -eu

python=${PYTHON:-python3}
pip_flags="--disable-pip-version-check --quiet"

usage() {
    echo "usage: build-env.sh wheel SRC DIST | venv DIST PREFIX" >&2
    exit 2
}

[ $# -eq 3 ] || usage
case "$1" in
wheel)
    # shellcheck disable=SC2086  # pip_flags is a list of flags
    "$python" -m pip wheel $pip_flags --no-deps --wheel-dir "$3" "$2"
    ;;
venv)
    set -- "$2"/firstbyte-*.whl "$3"
    if [ $# -ne 2 ] || [ ! -f "$1" ]; then
        echo "build-env.sh: expected exactly one firstbyte-*.whl in the wheel folder" >&2
        exit 1
    fi
    "$python" -m venv "$2"
    # shellcheck disable=SC2086
    "$2/bin/python" -m pip install $pip_flags "$1[router]"
    # The image runs the router, not pip: leave no installer behind in the environment.
    # shellcheck disable=SC2086
    "$2/bin/python" -m pip uninstall $pip_flags --yes pip
    ;;
*)
    usage
    ;;
esac
