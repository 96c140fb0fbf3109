"""`python -m radixlm ...` is the `radixlm` command."""

from radixlm.runtime.cli import main

main()
