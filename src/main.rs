//! The `capstore` binary: argument parsing, logging setup and exit codes. Everything else lives in the library.

mod cli;

fn main() {
    let exit_code = cli::main();
    std::process::exit(exit_code);
}
