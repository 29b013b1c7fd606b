/*
 * capstore publisher lease and fenced publish (DESIGN.md sections 6 and 7).
 *
 * One Promela process, the "world", whose every option is one atomic step of
 * a publisher, of the ClickHouse server, or of time.  See specs/README.md for
 * what is modelled, what is not, and which code each step stands for.
 *
 * Time is discrete and relative: every stored time is "ticks left" and the
 * tick step counts them all down, so the state space is finite and the
 * check covers unbounded runs.  Terms and versions are relative too (offset
 * from the head term, offset from max(version)).
 *
 * Variants (spin -DNAME -a lease.pml); expected verdicts are in check.sh:
 *   (none)          the design, 2 rival publishers
 *   STRICT_I3       I3 read literally (head has exactly one lease id at landing)
 *   NO_PT_MARGIN    fence without the publish_timeout margin
 *   REL_NEXT        release tombstone at head+1, not own term
 *   NO_QUAR         no quarantine after an unknown outcome
 *   SKEW_BUG        real skew 2 > declared skew 1
 *   TAKEOVER        same-spool takeover at once (DESIGN 7)
 *   TAKEOVER TAKEOVER_FIX  takeover only after PT + skew + delivery wait
 * Written but NOT yet run or validated (see README): OVERRUN, LIVE, N3.
 */

#ifdef N3
#define N 3
#else
#define N 2
#endif

#ifndef TTL
#define TTL 4
#endif
#ifndef MAXF
#define MAXF 2          /* unknown outcomes per run (fault budget)       */
#endif
#ifdef NO_QUAR
#define TWO_SLOTS 1     /* a second publish may go out while one is unknown */
#else
#define TWO_SLOTS 0     /* with quarantine it never can: one slot suffices */
#endif
#define PT 2            /* publish_timeout = max_execution_time          */
#define SK 1            /* declared clock_skew                           */
#define MARGIN 0        /* the 0.1 s: below one tick (see README)        */
#ifdef SKEW_BUG
#define SR 2            /* real skew between a local clock and the server */
#else
#define SR SK
#endif
#define DEL 1           /* a statement is read by the server at most DEL
                           ticks after it was sent; a lease INSERT lands at
                           most DEL ticks after its SELECT was read        */
#ifdef OVERRUN
#define PLAND (PT+1)
#else
#define PLAND PT        /* publish lands <= PT ticks after its fence read */
#endif
#ifdef NO_PT_MARGIN
#define FENCE_MARGIN SK
#else
#define FENCE_MARGIN (PT+SK)
#endif
#ifdef TAKEOVER_FIX
#define TWAIT (PT+SK+DEL)
#else
#define TWAIT 0
#endif
#define SWAIT (TTL+PT+SK)       /* lease.start_wait default */
#ifndef LIVE_K
#define LIVE_K (SWAIT+2)        /* bounded liveness: held within K ticks */
#endif

/* lease ids: CUR(i) is publisher i's current lease_id, OLD(i) stands for
   every earlier lease_id of publisher i (one label: see README)          */
#define NID (2*N+1)
#define CUR(i) (2*(i)+1)
#define OLD(i) (2*(i)+2)
#define ABS 255

/* publisher states (lease_state: none, reacquiring=CLAIMING, held,
   quarantined, failed; DEAD = SIGKILLed, OFF = not running)             */
#define NONE 0
#define CLAIMING 1
#define HELD 2
#define QUAR 3
#define FAILED 4
#define DEAD 5
#define OFF 6

#define CLAIM 0
#define TOMB 1

/* ---- ClickHouse: the lease table at the head term ---------------------- */
byte nf;                /* unknown outcomes so far */
byte hx[NID];           /* per lease id: ABS, or ticks until expiry (min over
                           its rows) of its rows at the head term           */

/* ---- publishers -------------------------------------------------------- */
byte st[N];
byte dl[N];             /* local ticks left to the local deadline          */
byte lag[N];            /* server time - local time, 0..SR                  */
byte q[N];              /* local ticks of quarantine left                   */
short mt[N];            /* own term - head term (0 or -1), while held       */
#ifdef LIVE
byte sw[N];             /* start wait left                                  */
byte rc[N];             /* local ticks of continuous refusal (latch clock)  */
bool over;              /* faults are over; publisher 0 is gone             */
byte since;             /* ticks since faults were over (capped)            */
bit tried[N];           /* publisher 1 already made its claim this tick     */
#endif
#ifdef TAKEOVER
byte tw[N];             /* takeover wait left                               */
#endif

/* ---- the one lease statement slot of each publisher ------------------ */
byte cph[N];            /* 0 free, 1 sent, 2 read by server, 3 settled      */
bit  ckind[N];
short ct[N];            /* target term - head term                          */
bit  cok[N];            /* its WHERE passed                                 */
byte cexp[N];           /* ticks until expiry of the row it writes          */
byte clid[N];
byte csdl[N];           /* local deadline measured from before sending      */
byte cby[N];            /* ticks left before the server must act on it      */
bit  corph[N];          /* the sender no longer waits for its reply         */
bit  ccont[N];          /* another lease id has a row at its term           */
bit  cland[N];

/* ---- two publish statement slots per publisher (slot k of i = 2i+k) -- */
#define NS (2*N)
byte pph[NS];           /* 0 free, 1 sent, 2 fence read, 3 settled          */
short pd[NS];           /* V - max(version)                                 */
bit  pok[NS];
byte plid[NS];
byte pby[NS];
bit  porph[NS];
bit  pus[NS];           /* ghost: another lease id was acquired since sent  */
bit  pland[NS];

/* scratch (not part of the state) */
hidden byte hn, hsole, hmx, j, k, a;
hidden byte hlive, ok;

#ifdef TRACE_ON
#define TRACE(x) x
#else
#define TRACE(x) skip
#endif

/* property markers, always 0: they name the property in pan's message */
bit I3_publisher_held_head_lease;
bit I4_versions_gapless_increasing;
bit NO_OVERLAPPING_BELIEF;
bit LOST_LEASE_PUBLISHES_NOTHING;
bit LIVE_NO_LATCH;
bit LIVE_HELD_WITHIN_K;

inline headinfo() {
  hn = 0; hsole = 0; hmx = 0; j = 1;
  do
  :: j < NID ->
     if
     :: hx[j] != ABS -> hn++; hsole = j; if :: hx[j] > hmx -> hmx = hx[j] :: else fi
     :: else
     fi; j++
  :: else -> break
  od;
  hlive = (hmx > 0);
  if :: hn != 1 -> hsole = 0 :: else fi
}

/* the claim may proceed over a live head: the head's only lease id is ours,
   or (same-spool takeover) one of our dead predecessor's                   */
#ifdef TAKEOVER
#define OURS(i) (hsole == CUR(i) || ((i) == 1 && tw[1] == 0 && (hsole == CUR(0) || hsole == OLD(0))))
#else
#define OURS(i) (hsole == CUR(i))
#endif

inline head_moved() {   /* a row landed at head+1: every offset shifts */
  j = 0;
  do
  :: j < N ->
     if :: cph[j] != 0 && ct[j] > -1 -> ct[j]-- :: else fi;
     if :: mt[j] > -1 -> mt[j]-- :: else fi;
     j++
  :: else -> break
  od
}

inline genchange(i) {   /* publisher i takes a fresh lease_id */
  if
  :: hx[CUR(i)] != ABS ->
     if
     :: hx[OLD(i)] == ABS || hx[CUR(i)] < hx[OLD(i)] -> hx[OLD(i)] = hx[CUR(i)]
     :: else
     fi;
     hx[CUR(i)] = ABS
  :: else
  fi;
  if :: clid[i] == CUR(i) -> clid[i] = OLD(i) :: else fi;
  if :: plid[2*i] == CUR(i) -> plid[2*i] = OLD(i) :: else fi;
  if :: plid[2*i+1] == CUR(i) -> plid[2*i+1] = OLD(i) :: else fi
}

inline orphan_all(i) {  /* stop waiting for every reply of publisher i */
  if :: cph[i] == 3 -> cph[i] = 0 :: cph[i] != 0 -> corph[i] = 1 :: else fi;
  if :: pph[2*i] == 3 -> pph[2*i] = 0 :: pph[2*i] != 0 -> porph[2*i] = 1 :: else fi;
  if :: pph[2*i+1] == 3 -> pph[2*i+1] = 0 :: pph[2*i+1] != 0 -> porph[2*i+1] = 1 :: else fi
}

inline quarantine(i) {
  st[i] = QUAR; q[i] = TTL; orphan_all(i)
}

/* LeaseStore::claim (claim and renew): read the head, refuse or send the
   conditional INSERT..SELECT at head+1                                    */
inline claim_send(i) {
  TRACE(printf("claim_send P%d\n", i));
#ifdef LIVE
  tried[i] = 1;
#endif
  headinfo();
  if
  :: hlive && !OURS(i) ->               /* refused */
     if :: st[i] == HELD -> st[i] = NONE :: else fi
#ifdef LIVE
     ; if :: rc[i] >= 2*TTL && sw[i] == 0 -> st[i] = FAILED :: else fi
#endif
  :: else ->
     cph[i] = 1; ckind[i] = CLAIM; ct[i] = 1; cok[i] = 0; cexp[i] = 0;
     clid[i] = CUR(i); csdl[i] = TTL - SK - MARGIN; cby[i] = DEL;
     corph[i] = 0; ccont[i] = 0; cland[i] = 0;
     if :: st[i] == NONE -> st[i] = CLAIMING :: else fi
  fi
}

/* server reads the statement's SELECT */
inline claim_eval(i) {
  TRACE(printf("claim_eval P%d\n", i));
  if
  :: ckind[i] == CLAIM -> cok[i] = (ct[i] == 1); cexp[i] = TTL
  :: else ->
#ifdef REL_NEXT
     ct[i] = 1;
#endif
     cok[i] = 1; cexp[i] = 0
  fi;
  cph[i] = 2; cby[i] = DEL
}

/* the INSERT's row becomes visible */
inline claim_land(i) {
  TRACE(printf("claim_land P%d\n", i));
  if
  :: cok[i] && ct[i] == 1 ->
     j = 1; do :: j < NID -> hx[j] = ABS; j++ :: else -> break od;
     hx[clid[i]] = cexp[i]; head_moved(); cland[i] = 1
  :: cok[i] && ct[i] == 0 ->
     j = 1;
     do
     :: j < NID -> if :: j != clid[i] && hx[j] != ABS -> ccont[i] = 1 :: else fi; j++
     :: else -> break
     od;
     j = 0;
     do
     :: j < N -> if :: j != i && cph[j] >= 2 && cland[j] && ct[j] == 0 && clid[j] != clid[i] -> ccont[j] = 1 :: else fi; j++
     :: else -> break
     od;
     if :: hx[clid[i]] == ABS || cexp[i] < hx[clid[i]] -> hx[clid[i]] = cexp[i] :: else fi;
     cland[i] = 1
  :: cok[i] && ct[i] < 0 -> cland[i] = 1; ccont[i] = 1  /* below the head: see README */
  :: else
  fi;
  if :: corph[i] -> cph[i] = 0 :: else -> cph[i] = 3 fi
}

/* the reply and the read-back of our term */
inline claim_reply(i) {
  TRACE(printf("claim_reply P%d\n", i));
  if
  :: ckind[i] == CLAIM && cok[i] && cland[i] && !ccont[i] && csdl[i] > 0 ->
     j = 0;
     do
     :: j < N -> assert(j == i || !(st[j] == HELD && dl[j] > 0) || NO_OVERLAPPING_BELIEF); j++
     :: else -> break
     od;
     j = 0;
     do
     :: j < NS -> if :: pph[j] != 0 && plid[j] != clid[i] -> pus[j] = 1 :: else fi; j++
     :: else -> break
     od;
     st[i] = HELD; dl[i] = csdl[i]; mt[i] = ct[i]
#ifdef LIVE
     ; rc[i] = 0
#endif
  :: else -> st[i] = NONE
  fi;
  cph[i] = 0
}

/* the reply is lost: unknown outcome */
inline claim_unknown(i) {
  TRACE(printf("claim_unknown P%d\n", i));
  if :: cph[i] == 3 -> cph[i] = 0 :: else -> corph[i] = 1 fi;
#ifdef NO_QUAR
  if :: st[i] == CLAIMING -> st[i] = NONE :: else fi
#else
  quarantine(i)
#endif
}

/* LeaseStore::release: tombstone (expiry = now) at our own term, then exit */
inline release(i) {
  TRACE(printf("release P%d\n", i));
  cph[i] = 1; ckind[i] = TOMB; ct[i] = mt[i]; cok[i] = 0; cexp[i] = 0;
  clid[i] = CUR(i); cby[i] = DEL; corph[i] = 1; ccont[i] = 0; cland[i] = 0;
  st[i] = OFF;
  orphan_all(i)
}

/* Publisher::publish_batch: V = watermark + 1, fenced INSERT..SELECT */
inline pub_send(i, s) {
  TRACE(printf("pub_send slot %d\n", s));
  pph[s] = 1; pd[s] = 1; pok[s] = 0; plid[s] = CUR(i); pby[s] = DEL;
  porph[s] = 0; pus[s] = 0; pland[s] = 0
}

/* fence_condition and max(version) < V, read when the SELECT runs */
inline pub_eval(s) {
  TRACE(printf("pub_eval slot %d\n", s));
  headinfo();
  pok[s] = (hn == 1 && hsole == plid[s] && hx[hsole] > FENCE_MARGIN && pd[s] >= 1);
  pph[s] = 2; pby[s] = PLAND
}

inline pub_land(s) {
  TRACE(printf("pub_land slot %d\n", s));
  if
  :: pok[s] ->
     headinfo();
#ifdef STRICT_I3
     ok = (hn == 1 && hsole == plid[s] && hlive);
#else
     /* its lease id has a live row at the head term, and no other lease id
        at the head term is held by any process (see README: I3)          */
     ok = (hx[plid[s]] != ABS && hx[plid[s]] > 0);
     j = 0;
     do
     :: j < N -> if :: st[j] == HELD && dl[j] > 0 && CUR(j) != plid[s] && hx[CUR(j)] != ABS -> ok = 0 :: else fi; j++
     :: else -> break
     od;
#endif
     assert(ok || I3_publisher_held_head_lease);
     assert(pd[s] == 1 || I4_versions_gapless_increasing);
     assert(!pus[s] || LOST_LEASE_PUBLISHES_NOTHING);
     j = 0;
     do :: j < NS -> if :: pph[j] != 0 && pd[j] > -1 -> pd[j]-- :: else fi; j++
     :: else -> break
     od;
     pland[s] = 1
  :: else
  fi;
  if :: porph[s] -> pph[s] = 0 :: else -> pph[s] = 3 fi
}

/* Publisher::read_back by publish_id */
inline pub_reply(i, s) {
  TRACE(printf("pub_reply slot %d\n", s));
  if :: !pland[s] && st[i] == HELD -> st[i] = NONE :: else fi;
  pph[s] = 0
}

inline pub_unknown(i, s) {
  TRACE(printf("pub_unknown slot %d\n", s));
  if :: pph[s] == 3 -> pph[s] = 0 :: else -> porph[s] = 1 fi;
#ifndef NO_QUAR
  quarantine(i)
#endif
}

/* ---- time ------------------------------------------------------------ */
inline advance_local(i) {      /* local clock of i moved a ticks */
  if
  :: st[i] == HELD -> if :: dl[i] > a -> dl[i] = dl[i] - a :: else -> dl[i] = 0; st[i] = NONE fi
  :: st[i] == QUAR -> if :: q[i] > a -> q[i] = q[i] - a :: else -> q[i] = 0; st[i] = NONE; genchange(i) fi
  :: else
  fi;
  if :: cph[i] != 0 -> if :: csdl[i] > a -> csdl[i] = csdl[i] - a :: else -> csdl[i] = 0 fi :: else fi;
#ifdef LIVE
  if :: sw[i] > a -> sw[i] = sw[i] - a :: else -> sw[i] = 0 fi;
  if :: sw[i] == 0 && (st[i] == NONE || st[i] == CLAIMING) -> rc[i] = rc[i] + a; if :: rc[i] > 2*TTL -> rc[i] = 2*TTL :: else fi :: else fi;
#endif
#ifdef TAKEOVER
  if :: tw[i] > a -> tw[i] = tw[i] - a :: else -> tw[i] = 0 fi;
#endif
  skip
}

inline server_tick() {
  j = 1;
  do :: j < NID -> if :: hx[j] != ABS && hx[j] > 0 -> hx[j]-- :: else fi; j++
  :: else -> break
  od;
  j = 0;
  do
  :: j < N ->
     if :: cph[j] == 1 || cph[j] == 2 -> cby[j]-- :: else fi;
     if :: cph[j] == 2 && cexp[j] > 0 -> cexp[j]-- :: else fi;
     j++
  :: else -> break
  od;
  j = 0;
  do :: j < NS -> if :: pph[j] == 1 || pph[j] == 2 -> pby[j]-- :: else fi; j++
  :: else -> break
  od
}

/* the server must act on a statement before its bound runs out */
#define SLOT_DUE(i) ((cph[i] == 1 || cph[i] == 2) && cby[i] == 0)
#define PSLOT_DUE(s) ((pph[s] == 1 || pph[s] == 2) && pby[s] == 0)

#define RUNS(i) (st[i] != DEAD && st[i] != OFF && st[i] != FAILED)
#define BUSYPUB(i) ((pph[2*(i)] != 0 && !porph[2*(i)]) || (pph[2*(i)+1] != 0 && !porph[2*(i)+1]))

#ifdef LIVE
/* once faults are over, publisher 1 acts without delay and the server
   answers at once: time may pass only when 1 has nothing to do            */
#define URGENT (over && ((cph[1] != 0 && !corph[1]) || BUSYPUB(1) || \
                 ((st[1] == NONE || st[1] == HELD) && cph[1] == 0 && !tried[1])))
#define FAULTS (!over)
#else
#define URGENT 0
#define FAULTS 1
#endif

#ifdef N3
#define NOTHING_DUE (!SLOT_DUE(0) && !SLOT_DUE(1) && !SLOT_DUE(2) && !PSLOT_DUE(0) && !PSLOT_DUE(1) && \
                     !PSLOT_DUE(2) && !PSLOT_DUE(3) && !PSLOT_DUE(4) && !PSLOT_DUE(5))
#else
#define NOTHING_DUE (!SLOT_DUE(0) && !SLOT_DUE(1) && !PSLOT_DUE(0) && !PSLOT_DUE(1) && !PSLOT_DUE(2) && !PSLOT_DUE(3))
#endif

hidden byte adv[N];    /* local clock advance of each publisher this tick */

inline choose_adv(i) {
  if
  :: !RUNS(i) -> adv[i] = 1
  :: RUNS(i) && lag[i] < SR -> adv[i] = 0
  :: RUNS(i) -> adv[i] = 1
  :: RUNS(i) && lag[i] > 0 -> adv[i] = 2
  fi
}

inline tick() {
  TRACE(printf("tick adv %d %d\n", adv[0], adv[1]));
  server_tick();
  k = 0;
  do
  :: k < N ->
     if
     :: RUNS(k) -> a = adv[k]; lag[k] = lag[k] + 1 - a; advance_local(k)
     :: else -> lag[k] = 0
     fi;
     k++
  :: else -> break
  od
#ifdef LIVE
  ; if :: over && since < LIVE_K + 1 -> since++ :: else fi
  ; tried[0] = 0; tried[1] = 0
#endif
  ; skip
}

#ifdef LIVE
/* publisher 0 is gone; publisher 1 restarts as a fresh process */
inline faults_over() {
  over = 1;
  st[0] = DEAD; orphan_all(0);
  orphan_all(1); genchange(1);
  st[1] = NONE; sw[1] = SWAIT; rc[1] = 0;
  lag[0] = 0
}
#endif

#define PUB(i) \
  :: d_step { RUNS(i) && (st[i] == NONE || st[i] == HELD) && cph[i] == 0 CLAIM_GUARD(i) -> claim_send(i) } \
  :: d_step { cph[i] == 1 -> claim_eval(i) } \
  :: d_step { cph[i] == 2 -> claim_land(i) } \
  :: d_step { cph[i] == 3 && !corph[i] && RUNS(i) -> claim_reply(i) } \
  :: d_step { FAULTS && nf < MAXF && cph[i] != 0 && !corph[i] && RUNS(i) -> nf++; claim_unknown(i) } \
  :: d_step { RELEASE_GUARD(i) st[i] == HELD && cph[i] == 0 && !BUSYPUB(i) -> release(i) } \
  :: d_step { RESTART_GUARD(i) st[i] == OFF && cph[i] == 0 && pph[2*i] == 0 && pph[2*i+1] == 0 -> \
              genchange(i); st[i] = NONE } \
  :: d_step { st[i] == HELD && dl[i] >= PT + SK && !BUSYPUB(i) && pph[2*i] == 0 -> pub_send(i, 2*i) } \
  :: d_step { TWO_SLOTS && st[i] == HELD && dl[i] >= PT + SK && !BUSYPUB(i) && pph[2*i] != 0 && pph[2*i+1] == 0 -> pub_send(i, 2*i+1) } \
  PSLOT(i, 2*i) PSLOT(i, 2*i+1)

#define PSLOT(i, s) \
  :: d_step { pph[s] == 1 -> pub_eval(s) } \
  :: d_step { pph[s] == 2 -> pub_land(s) } \
  :: d_step { pph[s] == 3 && !porph[s] -> pub_reply(i, s) } \
  :: atomic { FAULTS && pph[s] != 0 && !porph[s] && RUNS(i) -> pub_unknown(i, s) }

#ifdef TAKEOVER
#define CLAIM_GUARD(i)
#define RELEASE_GUARD(i) false &&
#define RESTART_GUARD(i) false &&
#elif defined(LIVE)
#define CLAIM_GUARD(i)
#define RELEASE_GUARD(i) !over &&
#define RESTART_GUARD(i) !over &&
#else
#define CLAIM_GUARD(i)
#define RELEASE_GUARD(i)
#define RESTART_GUARD(i)
#endif

init {
  j = 1; do :: j < NID -> hx[j] = ABS; j++ :: else -> break od;
#ifdef TAKEOVER
  st[1] = OFF;
#endif
#ifdef LIVE
  sw[0] = SWAIT; sw[1] = SWAIT;
#endif
  do
  PUB(0)
  PUB(1)
#ifdef N3
  PUB(2)
#endif
  :: atomic {
       (!URGENT) && NOTHING_DUE -> choose_adv(0); choose_adv(1);
#ifdef N3
       choose_adv(2);
#endif
       d_step { tick() }
#ifdef LIVE
       ; assert(!over || st[1] != FAILED || LIVE_NO_LATCH)
       ; assert(!over || since <= LIVE_K || st[1] == HELD || LIVE_HELD_WITHIN_K)
#endif
     }
#ifdef TAKEOVER
  /* SIGKILL of publisher 0; publisher 1, same spool id, gets the flock */
  :: atomic { st[0] != DEAD && st[1] == OFF ->
       st[0] = DEAD; orphan_all(0); lag[0] = 0;
       st[1] = NONE; tw[1] = TWAIT }
#endif
#ifdef LIVE
  :: atomic { !over -> faults_over() }
#endif
  od
}
