from kvstore_service.cli import main

main()
