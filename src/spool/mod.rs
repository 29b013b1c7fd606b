pub mod pack;
