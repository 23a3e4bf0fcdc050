"""Word lists for the generated tokenizer corpus (common English and programming vocabulary)."""

ENGLISH = """
a able about above accept access according account across act action active actually add added address
after again against age agent ago agree ahead air all allow almost alone along already also although always
among amount analysis and another answer any anyone anything appear apply approach area argue arm around
arrive art article as ask assume at attack attention author available avoid away back bad bag ball bank bar
base be beat beautiful because become bed before begin behavior behind believe below benefit best better
between beyond big bill bit black blue board body book born both box boy break bring brother budget build
building business but buy by call camera campaign can cancer candidate capital car card care career carry
case catch cause cell center central century certain certainly chair challenge chance change character
charge check child choice choose church citizen city civil claim class clear clearly close coach cold
collection college color come commercial common community company compare computer concern condition
conference consider consumer contain continue control cost could country couple course court cover create
crime cultural culture cup current customer cut dark data daughter day dead deal death debate decade decide
decision deep default defense degree delete deliver demand democratic describe design despite detail
determine develop development die difference different difficult dinner direction director discover discuss
discussion disease do doctor dog door down draw dream drive drop drug during each early east easy eat
economic economy edge education effect effort eight either election else employee end energy enjoy enough
enter entire environment environmental error especially establish even evening event ever every everybody
everyone everything evidence exactly example executive exist expect experience expert explain eye face fact
factor fail fall family far fast father fear federal feel feeling few field fight figure fill film final
finally financial find fine finger finish fire firm first fish five floor fly focus follow food foot for
force foreign forget form former forward four free friend from front full fund future game garden gas
general generation get girl give glass go goal good government great green ground group grow growth guess
gun guy hair half hand hang happen happy hard have he head health hear heart heat heavy help her here
herself high him himself his history hit hold home hope hospital hot hotel hour house how however huge human
hundred husband idea identify if image imagine impact important improve in include including increase indeed
indicate individual industry information inside instead institution interest interesting international
interview into investment involve issue it item its itself job join just keep key kid kill kind kitchen
know knowledge land language large last late later laugh law lawyer lay lead leader learn least leave left
leg legal less let letter level lie life light like likely line list listen little live local long look
lose loss lot love low machine magazine main maintain major majority make man manage management manager many
market marriage material matter may maybe me mean measure media medical meet meeting member memory mention
message method middle might military million mind minute miss mission model modern moment money month more
morning most mother mouth move movement movie much music must my myself name nation national natural nature
near nearly necessary need network never new news newspaper next nice night no none nor north not note
nothing notice now number occur of off offer office officer official often oh oil ok old on once one only
onto open operation opportunity option or order organization other others our out outside over own owner
page pain painting paper parent part participant particular particularly partner party pass past patient
pattern pay peace people per perform performance perhaps period person personal phone physical pick picture
piece place plan plant play player point police policy political politics poor popular population position
positive possible power practice prepare present president pressure pretty prevent price private probably
problem process produce product production professional professor program project property protect prove
provide public pull purpose push put quality question quickly quite race radio raise range rate rather reach
read ready real reality realize really reason receive recent recently recognize record red reduce reflect
region relate relationship religious remain remember remove report represent require research resource
respond response responsibility rest result return reveal rich right rise risk road rock role room rule run
safe same save say scene school science scientist score sea season seat second section security see seek
seem sell send senior sense series serious serve service set seven several shake share she shoot short
shot should shoulder show side sign significant similar simple simply since sing single sister sit site
situation six size skill skin small smile so social society soldier some somebody someone something
sometimes son song soon sort sound source south southern space speak special specific speech spend sport
spring staff stage stand standard star start state statement station stay step still stock stop store story
strategy street strong structure student study stuff style subject success successful such suddenly suffer
suggest summer support sure surface system table take talk task tax teach teacher team technology television
tell ten tend term test than thank that the their them themselves then theory there these they thing think
third this those though thought thousand threat three through throughout throw thus time to today together
tonight too top total tough toward town trade traditional training travel treat treatment tree trial trip
trouble true truth try turn type under understand unit until up upon us use usually value various very
victim view violence visit voice vote wait walk wall want war watch water way we weapon wear week weight well
west western what whatever when where whether which while white who whole whom whose why wide wife will win
wind window wish with within without woman wonder word work worker world worry would write writer wrong yard
yeah year yes yet you young your yourself
are is was were has had been being did does done am i user users query queries tool tools file files
function functions provided signature signatures within assistant json object objects argument arguments
returns called calls ran running wrote written updated created deleted changed fixed tested passed failed
"""

CODE = """
abs abstract accumulator adapter add_argument addEventListener after_each align alloc allocate any api app
append apply argparse args argv array assert assertEqual async asyncio attr await axios backend base64
batch before_each begin bin bind bits bool boolean break buf buffer bytes cache callback catch cfg char chmod
chunk class classmethod clear cli client clone close cmd code collections commit compile concat conn connect
console const constructor content context continue copy count cpu crate create_app csv ctx cursor dataclass
datetime db debug decode decorator deepcopy def default defer del delete deps deque describe dest dict diff
dir dirname docker dotenv dump dumps elif else emit encode encoding endpoint enum env environ eq err errno
error eval event except exception exec exists exit expect export extend extends fetch field filename files
filter finally fixture flag float flush fmt fn for format fstring func function gc generator get getattr
getenv git glob goroutine grep handler hash hasattr header headers heap hook host href html http https id
idx if impl import imports index info init input insert instance int interface isinstance isdigit items
iter iterator json keys kwargs lambda len let lib lint list listdir load loads localhost lock log logger
logging lower lstrip main makedirs malloc map match math max memo merge meta method middleware min mkdir mock
mod module mut mutex namespace new next nil node none nonlocal not npm null num object offset ok open opts
os package panic param params parse parser partial patch path pathlib pid pipe pkg plugin pop port post
pprint print private proc process promise props proto protected pub public push put pytest queue raise
random range re read readline readlines reduce ref regex register release reload remove rename render repo
req request require requests res reset resolve resp response rest result ret return reverse rmdir route
router rstrip rust schema scope script self send seq serde serialize server set setattr settings setup
shell shutil signal size slice sleep socket sort sorted split src stack start startswith stat static status
std stderr stdin stdout step str strict string strip struct sub subprocess sudo sum super switch symlink sync
sys table target task tasks temp tempfile template test tests then this thread throw time timeout tmp todo
token tokens trace traceback trait true try tuple type typeof typing u8 uint undefined unittest unwrap update
upper url urllib usize util utils uuid val validate value values var vec version void wait walk warn where
while with worker wrapper write writelines yaml yield zip
"""
