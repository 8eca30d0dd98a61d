from eyas.cli import main

main()
