from toolkit.cli.app import main

main()
