"""`python -m kuangchao.api.server`: run the REST API with uvicorn."""

from kuangchao.api.server.serve import main

main()
