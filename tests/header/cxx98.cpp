/* tests/header/c99.c compiled as C++98 with -pedantic-errors: older frontends still build as
 * C++03, and one trailing comma in an enum (a C++11 extension) stopped every file that included
 * kvrouter.h there.  The same program as the C99 one, which C++98 also reads. */
#include "c99.c"
