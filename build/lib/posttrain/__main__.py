from posttrain.lit.cli import main

main()
