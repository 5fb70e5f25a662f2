from lit.cli import main

main()
