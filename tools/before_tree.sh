#!/usr/bin/env bash
# The source tree of an older commit in .before/ (git-ignored), for `tools/device_run.sh before-after`:
#   bash tools/before_tree.sh COMMIT     then carry [".whl", ".before"] with the device call
set -euo pipefail
commit=${1:?usage: tools/before_tree.sh COMMIT}
cd "$(git rev-parse --show-toplevel)"
rm -rf .before && mkdir .before
git archive "$commit" src profiles | tar -x -C .before
git rev-parse "$commit" > .before/COMMIT
du -sh .before
