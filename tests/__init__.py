# The test tree is the package `tests`, so none of its folders becomes a top-level name
# that could shadow an installed package (tests/kernels once hid Hugging Face's `kernels`).
