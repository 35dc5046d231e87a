"""`python -m kuangchao.api.cli`: the same as `kc`."""

from kuangchao.api.cli.main import main

main()
