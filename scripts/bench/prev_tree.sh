# Sourced by the before/after scripts of this folder: `source prev_tree.sh DEFAULT_OUT HARNESS...`
# sets $out (the absolute $OUT, else DEFAULT_OUT), gives the earlier tree $PREV this tree's carried
# packages (.whl, .devsite) and copies this tree's harness files HARNESS into it, so that both
# sides are measured by the same scripts.
out=$(realpath -m "${OUT:-$1}")
shift
mkdir -p "$out"
ln -sfn "$PWD/.whl" "$PREV/.whl"
ln -sfn "$PWD/.devsite" "$PREV/.devsite"
cp "$@" "$PREV/scripts/bench/"
